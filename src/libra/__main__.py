import sys

from libra.cli.main import main

sys.exit(main())
