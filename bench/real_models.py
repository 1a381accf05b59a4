"""Does the budget hold on real models nobody here wrote?  Memory and gradients only, no timings.

Each case builds a model from code or a config with random weights (no downloads), trains a Libra copy and an eager
copy side by side with identical seeds, and checks, for a plan at 50% of eager's activation memory and one at the
planner's minimum budget, that the CPU allocator's measured peak (``libra.testing.AllocatorMeter``) stays within the
budget and that every gradient, parameter and buffer is bit-identical to eager.

Two suites, each in its own virtual environment (torchvision does not import beside the main venv's torch):

    .venv-vision/bin/python bench/real_models.py --suite vision     # torchvision + timm
    .venv/bin/python bench/real_models.py --suite hf                # transformers

``--only a,b`` runs only the named cases. Results go to ``bench/results/real_models_<suite>.json`` (with ``--only``,
``real_models_<suite>_only.json``) and a markdown table is printed.

``--host-bandwidth B`` plans with offloading too, as if the device had a host link of B bytes per second (CPU has
none of its own). On CPU the host copies are taken from the same allocator the meter reads, so a step may measure up
to the budget plus the host buffers its offloads hold (the run's pool; the tolerance applies on top); results go to
``real_models_<suite>_offload.json``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import libra
from libra.planner import Planning
from libra.runtime.apply import _ACTIVE_ATTR
from libra.testing import AllocatorMeter, assert_grads_equal

MISPREDICTED = Path(__file__).resolve().parent / "results" / "mispredicted"  # profiles whose plan measured above it

MiB = 2**20
KiB = 2**10
STEPS = 3
RESULTS = Path(__file__).resolve().parent / "results"


# cases known to go over budget, with gradients still bit-equal: what is left of issue 14 (the run fails if one of
# them stops going over, so that this list stays true)
KNOWN_OVER: set[tuple[str, str]] = set()
# (hf.whisper_layerdrop at the minimum was here, 35.2 MiB against 33.7, until plans reserved the inputs of the layers
# the profiled step skipped: NOTE [Layers the profiled step skipped] in planner/__init__.py)


def _grads_equal(eager, ours) -> tuple[bool, str]:
    """Whether every gradient, parameter and buffer is bit-identical, and the first difference if not."""
    try:
        assert_grads_equal(eager, ours)
        return True, ""
    except AssertionError as e:
        return False, str(e)


def within(measured: int, budget: int) -> bool:
    return measured <= budget + 0.01 * budget + 256 * KiB


# --------------------------------------------------------------------------------------------------------------------
# cases: name -> (description of the input, build() -> model, inputs dict, loss(model, inputs) -> scalar tensor)


def _images(b, size, classes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(b, 3, size, size, generator=g), "y": torch.randint(0, classes, (b,), generator=g)}


def _masks(b, size, classes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(b, 3, size, size, generator=g),
            "y": torch.randint(0, classes, (b, size, size), generator=g)}


def _detection(n, size, seed=3):
    """Images and three boxes each, as torchvision's detection models take them in training (lists of images and
    of target dicts; the model computes its own losses)."""
    g = torch.Generator().manual_seed(seed)
    images = [torch.rand(3, size, size, generator=g) for _ in range(n)]
    targets = []
    for _ in range(n):
        corner = torch.rand(3, 2, generator=g) * (size - 80)
        targets.append({"boxes": torch.cat([corner, corner + 20 + torch.rand(3, 2, generator=g) * 60], 1),
                        "labels": torch.randint(1, 5, (3,), generator=g)})
    return {"images": images, "targets": targets}


def _det_loss(model, inp):
    return sum(model(inp["images"], inp["targets"]).values())


def _cls_loss(model, inp):
    return F.cross_entropy(model(inp["x"]), inp["y"])


def _seg_loss(model, inp):
    return F.cross_entropy(model(inp["x"])["out"], inp["y"])


def vision_cases():
    import timm
    import torchvision.models as tvm
    import torchvision.models.detection as tvd
    import torchvision.models.segmentation as tvs

    def tv(fn, **kw):
        return lambda: fn(weights=None, **kw)

    def seg(fn):
        return lambda: fn(weights=None, weights_backbone=None, num_classes=21, aux_loss=False)

    def tm(name, **kw):
        return lambda: timm.create_model(name, pretrained=False, **kw)

    cases = {
        "tv.resnet50": (tv(tvm.resnet50), lambda: _images(8, 160, 1000), _cls_loss, "8x3x160x160"),
        "tv.efficientnet_b0": (tv(tvm.efficientnet_b0), lambda: _images(8, 160, 1000), _cls_loss, "8x3x160x160"),
        "tv.mobilenet_v3_large": (tv(tvm.mobilenet_v3_large), lambda: _images(8, 160, 1000), _cls_loss, "8x3x160x160"),
        "tv.convnext_tiny": (tv(tvm.convnext_tiny), lambda: _images(8, 128, 1000), _cls_loss, "8x3x128x128"),
        "tv.swin_t": (tv(tvm.swin_t), lambda: _images(4, 224, 1000), _cls_loss, "4x3x224x224"),
        "tv.vit_b_16": (tv(tvm.vit_b_16), lambda: _images(4, 224, 1000), _cls_loss, "4x3x224x224"),
        "tv.deeplabv3_mobilenet_v3_large": (seg(tvs.deeplabv3_mobilenet_v3_large), lambda: _masks(4, 160, 21), _seg_loss,
                                            "4x3x160x160, mask"),
        "tv.fcn_resnet50": (seg(tvs.fcn_resnet50), lambda: _masks(4, 128, 21), _seg_loss, "4x3x128x128, mask"),
        # each dense layer is handed the list of features its block appends to after the call
        "tv.densenet121": (tv(tvm.densenet121), lambda: _images(4, 128, 1000), _cls_loss, "4x3x128x128"),
        # a backbone stage of a dozen small blocks; lists of images and target dicts in, its own losses out
        "tv.ssdlite320_mobilenet_v3_large": (lambda: tvd.ssdlite320_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=5), lambda: _detection(2, 320), _det_loss,
            "2x3x320x320, 3 boxes each"),
        "timm.resnet18d": (tm("resnet18d"), lambda: _images(8, 160, 1000), _cls_loss, "8x3x160x160"),
        "timm.efficientnet_lite0": (tm("efficientnet_lite0"), lambda: _images(8, 160, 1000), _cls_loss, "8x3x160x160"),
        "timm.vit_tiny_patch16_224": (tm("vit_tiny_patch16_224", drop_path_rate=0.1), lambda: _images(8, 224, 1000),
                                      _cls_loss, "8x3x224x224, drop_path 0.1"),
        "timm.convnext_atto": (tm("convnext_atto", drop_path_rate=0.1), lambda: _images(8, 160, 1000), _cls_loss,
                               "8x3x160x160, drop_path 0.1"),
    }
    return cases


def hf_cases():
    import transformers as tf

    V, B, S = 1000, 4, 128

    def ids(b=B, s=S, seed=1):
        return torch.randint(1, V, (b, s), generator=torch.Generator().manual_seed(seed))

    def causal(config, attn="sdpa"):
        return lambda: tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn)

    def hf_loss(model, inp):
        return model(**inp).loss

    common = dict(vocab_size=V, bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    llama_like = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, **common)

    def lm():
        x = ids()
        return {"input_ids": x, "labels": x}

    def mlm():
        x = ids(8, 128)
        masked = torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) < 0.15
        return {"input_ids": x.masked_fill(masked, 3), "labels": x.masked_fill(~masked, -100),
                "attention_mask": torch.ones_like(x)}

    def t5_in():
        return {"input_ids": ids(B, S, 3), "labels": ids(B, 64, 4)}

    def vit_in():
        g = torch.Generator().manual_seed(5)
        return {"pixel_values": torch.randn(8, 3, 64, 64, generator=g),
                "labels": torch.randint(0, 10, (8,), generator=g)}

    wcfg = tf.WhisperConfig(vocab_size=V, num_mel_bins=80, d_model=128, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
                            decoder_ffn_dim=512, max_source_positions=128, max_target_positions=128,
                            decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            use_cache=False, suppress_tokens=None, begin_suppress_tokens=None)

    def whisper_in():
        g = torch.Generator().manual_seed(6)
        return {"input_features": torch.randn(8, 80, 2 * 128, generator=g), "labels": ids(8, 64, 7)}

    mixtral = dict(llama_like, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2)
    gpt2 = causal(tf.GPT2Config(vocab_size=V, n_positions=256, n_embd=128, n_layer=4, n_head=4, bos_token_id=0,
                                eos_token_id=0, use_cache=False), attn="eager")

    def lm_lengths():
        return [{"input_ids": x, "labels": x} for x in (ids(B, 128, 11), ids(B, 96, 12), ids(B, 64, 13))]

    cases = {
        "hf.bert_mlm": (lambda: tf.BertForMaskedLM(tf.BertConfig(
            vocab_size=V, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
            max_position_embeddings=256, pad_token_id=0, attn_implementation="eager")),
            mlm, hf_loss, "8x128 ids, 15% masked"),
        "hf.t5": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=V, d_model=128, d_kv=32, d_ff=512, num_layers=3, num_decoder_layers=3, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False)),
            t5_in, hf_loss, "4x128 ids -> 4x64 labels"),
        "hf.llama": (causal(tf.LlamaConfig(**llama_like)), lm, hf_loss, "4x128 ids"),
        "hf.qwen2": (causal(tf.Qwen2Config(**llama_like, attention_dropout=0.1)), lm, hf_loss,
                     "4x128 ids, attn dropout 0.1"),
        "hf.mistral": (causal(tf.MistralConfig(**llama_like, sliding_window=64)), lm, hf_loss,
                       "4x128 ids, sliding window 64"),
        "hf.mixtral": (causal(tf.MixtralConfig(**mixtral)), lm, hf_loss, "4x128 ids, 4 experts top-2"),
        "hf.mixtral_jitter": (causal(tf.MixtralConfig(**mixtral, router_jitter_noise=0.1)), lm, hf_loss,
                              "4x128 ids, 4 experts top-2, jitter 0.1"),
        "hf.gpt2": (gpt2, lm, hf_loss, "4x128 ids, eager attn"),
        "hf.vit": (lambda: tf.ViTForImageClassification(tf.ViTConfig(
            image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=512, num_labels=10, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
            attn_implementation="sdpa")),
            vit_in, hf_loss, "8x3x64x64, patch 8, dropout 0.1"),
        "hf.whisper": (lambda: tf.WhisperForConditionalGeneration(wcfg), whisper_in, hf_loss,
                       "8x80x256 mel -> 8x64 labels"),
        "hf.opt": (causal(tf.OPTConfig(vocab_size=V, hidden_size=128, num_hidden_layers=4, ffn_dim=512,
                                       num_attention_heads=4, max_position_embeddings=256, dropout=0.1,
                                       word_embed_proj_dim=128, **{k: common[k] for k in ("bos_token_id",
                                       "eos_token_id", "pad_token_id", "use_cache")})),
                   lm, hf_loss, "4x128 ids, dropout 0.1"),
        "hf.gpt_neox": (causal(tf.GPTNeoXConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                                intermediate_size=512, max_position_embeddings=256,
                                                rotary_pct=0.25, use_parallel_residual=True, **common)),
                        lm, hf_loss, "4x128 ids, parallel residual, partial rotary"),
        "hf.phi": (causal(tf.PhiConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                       num_attention_heads=4, max_position_embeddings=256, partial_rotary_factor=0.5,
                                       resid_pdrop=0.1, **common)),
                   lm, hf_loss, "4x128 ids, partial rotary, dropout 0.1"),
        "hf.gemma": (causal(tf.GemmaConfig(**dict(llama_like, head_dim=32))), lm, hf_loss, "4x128 ids"),
        "hf.bart": (lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=V, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=256,
            dropout=0.1, pad_token_id=0, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
            use_cache=False)),
            t5_in, hf_loss, "4x128 ids -> 4x64 labels, dropout 0.1"),
        # the reference scan (no mamba_ssm kernels): a Python loop over time steps inside each mixer call
        "hf.mamba": (causal(tf.MambaConfig(hidden_size=64, num_hidden_layers=2, state_size=8, **common), attn="eager"),
                     lm, hf_loss, "4x128 ids, reference scan"),
        # layer drop: each step skips other layers than the profiled one did (control flow that leaves the plan)
        "hf.whisper_layerdrop": (lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(**dict(
            wcfg.to_dict(), encoder_layers=4, decoder_layers=4, encoder_layerdrop=0.3, decoder_layerdrop=0.3))),
            whisper_in, hf_loss, "8x80x256 mel -> 8x64 labels, 4+4 layers, layer drop 0.3, 10 steps", 10),
        # a sequence length drawn every step: a plan per length, made ahead from fake profiles
        "hf.gpt2_varlen": (gpt2, lm_lengths, hf_loss, "4x{128,96,64} ids, length drawn per step, 10 steps", 10),
    }
    return cases


# --------------------------------------------------------------------------------------------------------------------


def _tail(exc: BaseException, lines: int = 8) -> str:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(tb).rstrip().splitlines()
    return "\n".join(text[-lines:])


def run_model(name, build, make_inputs, loss_fn, desc, steps: int = STEPS,
              host_bandwidth: float | None = None) -> dict:
    """``make_inputs()`` returns one batch, or a list of batches of other shapes: the step is then
    profiled on the first, every other shape is planned ahead from a fake profile, each step trains on a shape
    drawn from a seeded generator, and one more step with a shape no plan was made for must raise before it
    allocates."""
    rec: dict = {"model": name, "input": desc, "cases": []}
    made = make_inputs()  # built per case, so that no other case's inputs are live (they would count as static)
    shapes = made if isinstance(made, list) else [made]
    inputs = shapes[0]
    torch.manual_seed(0)
    eager = build()
    eager.train()
    ours = copy.deepcopy(eager)
    rec["parameters_MiB"] = sum(p.numel() * p.element_size() for p in eager.parameters()) / MiB
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (eager, ours)]

    def step(model, batch=None):
        loss = loss_fn(model, inputs if batch is None else batch)
        loss.backward()
        return loss.detach()

    def finish():
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def resync():
        # after an exception in the Libra step: make the Libra copy equal to eager again
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        ours.load_state_dict(eager.state_dict())

    # warm-up, both copies, same seed
    for model in (eager, ours):
        torch.manual_seed(1)
        step(model)
    finish()

    torch.manual_seed(1234)
    prof = libra.profile(ours, lambda: step(ours))
    torch.manual_seed(1234)
    step(eager)
    rec["profile_grads_equal"], error = _grads_equal(eager, ours)
    if error:
        rec["profile_grads_error"] = error
    finish()

    planning = Planning(prof, host_bandwidth) if host_bandwidth else Planning(prof)
    min_budget = planning.min_budget_bytes()
    top = max(range(len(prof.ops)), key=lambda i: prof.ops[i].transient_bytes) if prof.ops else -1
    rec.update({
        "eager_peak_bytes": prof.eager_peak_bytes,
        "static_bytes": prof.static_bytes,
        "allocator": prof.allocator,
        "allocator_peak_bytes": prof.allocator_peak_bytes,
        "n_ops": len(prof.ops),
        "min_budget_bytes": min_budget,
        "max_transient_bytes": prof.ops[top].transient_bytes if top >= 0 else 0,
        "max_transient_op": f"{prof.ops[top].name} in {prof.ops[top].module or '<root>'}"
        + (" (backward)" if prof.ops[top].backward else "") if top >= 0 else "",
        "ops_with_transient": sum(1 for o in prof.ops if o.transient_bytes > 0),
    })

    # the other shapes' profiles, fake (no eager memory, nothing trained), made once
    others = [libra.profile(ours, lambda b=b: step(ours, b), fake=True) for b in shapes[1:]]
    draw = torch.Generator().manual_seed(17)
    seed_base = 100
    for case in ("50%", "minimum"):
        c: dict = {"case": case, "steps": []}
        rec["cases"].append(c)
        budget = max(prof.budget_for_share(0.5), min_budget) if case == "50%" else min_budget
        c["budget_bytes"] = budget
        try:
            plan = libra.plan(planning, budget)
            # one budget for every shape, each planned at it (a shorter one's minimum is no higher, in practice)
            plans = [plan] + [libra.plan(o, max(budget, Planning(o, host_bandwidth).min_budget_bytes()),
                                         host_bandwidth=host_bandwidth) for o in others]
        except libra.BudgetInfeasibleError as e:
            c["error"] = f"BudgetInfeasibleError: {str(e)[:2000]}"
            continue
        except Exception as e:  # noqa: BLE001
            c["error"] = _tail(e)
            continue
        c["predicted_peak_bytes"] = plan.predicted_peak_bytes
        c["refused"] = len(plan.refused)
        c["refused_list"] = [list(r) for r in plan.refused[:20]]
        c["counts"] = {str(k.value if hasattr(k, "value") else k): v for k, v in plan.counts.items()}
        c["regions"] = len(plan.regions)
        c["hooked"] = sum(1 for r in plan.regions if r.hooked)
        for i in range(1, steps + 1):
            k = int(torch.randint(len(shapes), (1,), generator=draw)) if len(shapes) > 1 else 0
            batch = shapes[k]
            s: dict = {"step": i, "shape": k}
            c["steps"].append(s)
            seed = seed_base + i
            torch.manual_seed(seed)
            try:
                with AllocatorMeter(extra=list(ours.parameters())) as m:
                    with libra.apply(ours, plans if len(plans) > 1 else plan):
                        session = ours.__dict__[_ACTIVE_ATTR]
                        loss_o = step(ours, batch)
                # on CPU host copies come from the metered allocator: the pool's buffers may come on top
                host = session.offload.pool.allocated_bytes if session.offload is not None else 0
                del session
            except Exception as e:  # noqa: BLE001
                s["error"] = _tail(e)
                torch.manual_seed(seed)
                step(eager, batch)
                finish()
                resync()
                continue
            torch.manual_seed(seed)
            with AllocatorMeter(extra=list(eager.parameters())) as me:
                loss_e = step(eager, batch)
            s["measured_peak_bytes"] = m.peak_bytes
            s["start_bytes"] = m.start_bytes
            s["host_buffer_bytes"] = host
            s["over_bytes"] = m.peak_bytes - host - plans[k].budget_bytes
            s["within_tolerance"] = within(m.peak_bytes - host, plans[k].budget_bytes)
            s["eager_measured_above_start_bytes"] = me.peak_bytes - me.start_bytes
            s["loss_equal"] = bool(torch.equal(loss_o, loss_e))
            s["grads_equal"], error = _grads_equal(eager, ours)
            if error:
                s["grads_error"] = error
            finish()
            if not s["grads_equal"]:
                resync()
            del loss_o, loss_e
        seed_base += 100
        c["explain"] = plan.explain()[:6000]
        above = [s["measured_peak_bytes"] - s["host_buffer_bytes"] - plans[s["shape"]].predicted_peak_bytes
                 for s in c["steps"] if "measured_peak_bytes" in s]
        if len(shapes) == 1 and above and max(above) > 0:
            # a peak above its prediction is a miss of the simulator's: keep what it planned from, to replay it
            # (libra.Profile.load, then libra.plan at c["budget_bytes"])
            saved = MISPREDICTED / f"{name}-{case.rstrip('%')}.json.gz"
            saved.parent.mkdir(parents=True, exist_ok=True)
            prof.save(saved)
            c["profile_saved"] = str(saved.relative_to(Path(__file__).resolve().parents[1]))
        if len(shapes) > 1:  # a shape no plan was made for: raises before the step allocates (on_over_budget="raise")
            unplanned = {k: v[:, : v.shape[1] - 8] if v.dim() == 2 else v for k, v in inputs.items()}
            u: dict = {"step": "unplanned shape", "raised": False}
            try:
                with AllocatorMeter(extra=list(ours.parameters())) as m:
                    with libra.apply(ours, plans):
                        step(ours, unplanned)
            except libra.UnplannedInputsError:
                u["raised"] = True
            u["allocated_before_raising_bytes"] = m.peak_bytes - m.start_bytes
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            c["unplanned"] = u
    del eager, ours, opts, prof, planning, others
    gc.collect()
    return rec


def summarize(c: dict) -> dict:
    ok = [s for s in c["steps"] if "measured_peak_bytes" in s]
    out = {
        "worst_measured": max((s["measured_peak_bytes"] for s in ok), default=None),
        "worst_over": max((s["over_bytes"] for s in ok), default=None),
        "within": all(s["within_tolerance"] for s in ok) if ok else None,
        "grads": all(s["grads_equal"] for s in ok) if ok else None,
        "errors": [s["error"] for s in c["steps"] if "error" in s],
    }
    if "unplanned" in c:  # with several shapes, the step with an unplanned one must have raised before allocating
        u = c["unplanned"]
        out["within"] = bool(out["within"]) and u["raised"] and u["allocated_before_raising_bytes"] <= 64 * KiB
    return out


def table(records: list[dict]) -> str:
    yn = {True: "yes", False: "**NO**", None: "-"}
    head = ("| model | input | eager peak MiB | static MiB | case | budget MiB | predicted MiB | worst measured MiB "
            "| worst over budget KiB | within tol | grads equal | refused |")
    rows = [head, "|" + "---|" * 12]
    for r in records:
        if "error" in r:
            rows.append(f"| {r['model']} | {r['input']} | - | - | - | - | - | - | - | - | - | "
                        f"EXCEPTION: {r['error'].splitlines()[-1][:120]} |")
            continue
        for c in r["cases"]:
            mib = lambda b: "-" if b is None else f"{b / MiB:.1f}"  # noqa: E731
            if "error" in c:
                msg = c["error"].splitlines()[0][:100]
                rows.append(f"| {r['model']} | {r['input']} | {mib(r['eager_peak_bytes'])} | "
                            f"{mib(r['static_bytes'])} | {c['case']} | {mib(c['budget_bytes'])} | - | - | - | - | - | "
                            f"{msg} |")
                continue
            s = summarize(c)
            over = "-" if s["worst_over"] is None else f"{s['worst_over'] / KiB:.0f}"
            note = f"{c['refused']}" + (f"; {len(s['errors'])} step error(s)" if s["errors"] else "")
            rows.append(f"| {r['model']} | {r['input']} | {mib(r['eager_peak_bytes'])} | {mib(r['static_bytes'])} | "
                        f"{c['case']} | {mib(c['budget_bytes'])} | {mib(c['predicted_peak_bytes'])} | "
                        f"{mib(s['worst_measured'])} | {over} | {yn[s['within']]} | {yn[s['grads']]} | {note} |")
    return "\n".join(rows)


def profile_table(records: list[dict]) -> str:
    rows = ["| model | allocator | ops with transient | max transient KiB (op) | min budget MiB | profile grads equal |",
            "|" + "---|" * 6]
    for r in records:
        if "error" in r:
            continue
        rows.append(f"| {r['model']} | {r['allocator'] or '-'} | {r['ops_with_transient']} / {r['n_ops']} | "
                    f"{r['max_transient_bytes'] / KiB:.0f} ({r['max_transient_op']}) | "
                    f"{r['min_budget_bytes'] / MiB:.1f} | {'yes' if r['profile_grads_equal'] else '**NO**'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("vision", "hf"), required=True)
    ap.add_argument("--only", default="", help="comma-separated case names (see --list)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both copies use the same)")
    ap.add_argument("--host-bandwidth", type=float, default=None,
                    help="bytes per second of a host link to plan offloading with (default: none, no offloading)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = vision_cases() if args.suite == "vision" else hf_cases()
    if args.list:
        print("\n".join(cases))
        return 0
    if args.only:
        want = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = [w for w in want if w not in cases]
        if unknown:
            ap.error(f"unknown case(s) {unknown}; known: {', '.join(cases)}")
        cases = {k: v for k, v in cases.items() if k in want}
    out_path = RESULTS / (f"real_models_{args.suite}" + ("_offload" if args.host_bandwidth else "")
                          + ("_only" if args.only else "") + ".json")
    meta = {"suite": args.suite, "torch": torch.__version__, "python": platform.python_version(),
            "threads": args.threads, "steps_per_case": STEPS, "steps_per_case_where_named": 10,
            "tolerance": "measured <= budget + 1% of budget + 256 KiB", "libra": libra.__version__,
            "host_bandwidth": args.host_bandwidth}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import timm
        import torchvision
        meta["torchvision"], meta["timm"] = torchvision.__version__, timm.__version__
    except Exception:  # noqa: BLE001
        pass
    records = []
    for name, (build, inputs, loss_fn, desc, *more) in cases.items():
        print(f"[real_models] {name} ({desc}) ...", file=sys.stderr, flush=True)
        try:
            rec = run_model(name, build, inputs, loss_fn, desc, *more, host_bandwidth=args.host_bandwidth)
        except Exception as e:  # noqa: BLE001
            rec = {"model": name, "input": desc, "error": _tail(e, 12)}
        gc.collect()
        records.append(rec)
        brief = "error" if "error" in rec else "; ".join(
            f"{c['case']}: " + ("plan error" if "error" in c else
                                f"over {summarize(c)['worst_over']} B, grads {summarize(c)['grads']}")
            for c in rec["cases"])
        print(f"[real_models]   {name}: {brief}", file=sys.stderr, flush=True)
        out_path.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    print(table(records))
    print()
    print(profile_table(records))
    failed, fixed = [], []
    for r in records:
        for c in r.get("cases", [{"case": "all", "error": r.get("error")}]):
            bad = "error" in c or not summarize(c)["grads"] or not summarize(c)["within"]
            known = (r["model"], c["case"]) in KNOWN_OVER and "error" not in c and summarize(c)["grads"]
            if bad and not known:
                failed.append(f"{r['model']} ({c['case']})")
            elif known and not bad:
                fixed.append(f"{r['model']} ({c['case']})")
    if failed or fixed:
        if failed:
            print(f"[real_models] over tolerance, gradients differing or failed: {', '.join(failed)}",
                  file=sys.stderr)
        if fixed:
            print(f"[real_models] now within budget, take them out of KNOWN_OVER: {', '.join(fixed)}",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
