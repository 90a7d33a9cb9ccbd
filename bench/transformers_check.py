"""variantgen inside transformers on the GPU: logits and greedy generate() against transformers' sdpa.

For each backend (--backends, default fa3,fa2,flex) and model (a Llama-style model: a left-padded
batch and packed documents; a Gemma 3 style multimodal model: image tokens, sliding and global
layers), both randomly initialised from configs in bf16 (nothing downloaded; head dim 128, which
the FlashInfer routes support): the model's sdpa output first, then the same model attached to
variantgen (variantgen.integrations.transformers.attach) on the same inputs. Records per case the
max abs logit difference and argmax agreement on real tokens, whether greedy tokens agree, the
routes and what served each call, and forward times. Writes bench/results/transformers-<date>-<gpu>.json
(and $OUT/ when set). Modules of the FlashInfer routes are built on first use (precompile them:
`variantgen precompile specs/{causal,sliding_window,mm_prefix,document}.yaml --head-dim 128 --dtype bf16
--backend fa2,fa3 --kind prefill,decode`).
    python bench/transformers_check.py [--backends flex] [--seq 512]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

import variantgen  # noqa: E402
from variantgen.integrations import transformers as vg_hf  # noqa: E402
from variantgen.testing.harness import source_commit  # noqa: E402

DTYPE = torch.bfloat16


def llama(layers: int, device: str):
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                   head_dim=128, max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device, DTYPE).eval()


def gemma3(layers: int, device: str):
    types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(layers)]
    tc = transformers.Gemma3TextConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=128, sliding_window=64, query_pre_attn_scalar=128,
                                       max_position_embeddings=8192, layer_types=types)
    vc = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=tc, vision_config=vc, mm_tokens_per_image=4, image_token_index=1000,
                                    boi_token_index=1001, eoi_token_index=1002, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(cfg).to(device, DTYPE).eval()


def inputs_for(kind: str, seq: int, device: str) -> tuple[dict, torch.Tensor]:
    """(model inputs, bool [batch, seq] of the real tokens whose logits are compared)."""
    g = torch.Generator().manual_seed(1)
    if kind == "llama_padded":
        ids = torch.randint(0, 1000, (4, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[1, : seq // 3] = 0
        mask[3, :7] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
    elif kind == "llama_packed":
        ids = torch.randint(0, 1000, (1, seq), generator=g)
        cuts = [0, seq // 5, seq // 2, seq - 17, seq]
        mask = torch.ones_like(ids)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None]  # 4 documents
        inputs = {"input_ids": ids, "position_ids": pos, "use_cache": False}
    else:
        ids = torch.randint(0, 1000, (2, seq), generator=g)
        tt = torch.zeros_like(ids)
        tt[:, 10:10 + seq // 4] = 1
        tt[1, seq // 2: seq // 2 + 40] = 1
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        inputs = {"input_ids": ids, "token_type_ids": tt, "attention_mask": mask}
    return ({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
            mask.bool().to(device))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_forward(model, inputs, iters=5):
    with torch.no_grad():
        model(**inputs)
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            out = model(**inputs).logits
        sync()
    return out, round((time.perf_counter() - t) / iters * 1e3, 2)


def check(model, kind: str, backend: str, seq: int, device: str) -> dict:
    inputs, valid = inputs_for(kind, seq, device)
    vg_hf.detach(model)
    ref, ref_ms = timed_forward(model, inputs)
    gen_inputs = {k: v for k, v in inputs.items() if k != "use_cache"}
    with torch.no_grad():
        ref_gen = model.generate(**gen_inputs, max_new_tokens=8, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True) if kind != "llama_packed" else None
    t = time.perf_counter()
    report = vg_hf.attach(model, backend=backend)
    row: dict = {"attach_s": round(time.perf_counter() - t, 2), "ok": report.ok, "sdpa_forward_ms": ref_ms,
                 "routes": {f"{spec}/{kind}": status for (spec, kind), status in report.routes.items()}}
    if not report.ok:
        return row
    out, row["variantgen_forward_ms"] = timed_forward(model, inputs)
    diff = (out.float() - ref.float())[valid].abs()
    row["max_abs_diff"] = diff.max().item()
    row["mean_abs_diff"] = diff.mean().item()
    row["argmax_agreement"] = (out.argmax(-1) == ref.argmax(-1))[valid].float().mean().item()
    if ref_gen is not None:
        with torch.no_grad():
            gen = model.generate(**gen_inputs, max_new_tokens=8, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        row["greedy_tokens_equal"] = bool(torch.equal(gen.sequences, ref_gen.sequences))
        row["greedy_token_agreement"] = (gen.sequences == ref_gen.sequences).float().mean().item()
        # scores until the first step where a row's greedy token differs (later steps see other prefixes)
        prompt = gen_inputs["input_ids"].shape[1]
        same = (gen.sequences[:, prompt:] == ref_gen.sequences[:, prompt:]).all(0).int().cumprod(0)
        steps = int(same.sum()) + 1
        row["max_abs_score_diff"] = max((a.float() - b.float()).abs().max().item()
                                        for a, b in list(zip(gen.scores, ref_gen.scores))[:steps])
    row["calls"] = dict(report.calls)
    vg_hf.detach(model)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="fa3,fa2,flex")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run of the script, flex only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        import flashinfer

        fi = flashinfer.__version__
    except ImportError:
        fi = None
    res: dict = {"commit": source_commit(), "date": datetime.date.today().isoformat(),
                 "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
                 "transformers": transformers.__version__, "flashinfer": fi, "variantgen": variantgen.__version__,
                 "dtype": "bf16", "seq": args.seq, "layers": args.layers, "cases": {}}
    name = f"transformers-{res['date']}-{res['gpu'].replace(' ', '_')}.json"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / name
    models = {"llama": llama(args.layers, args.device), "gemma3": gemma3(args.layers, args.device)}
    for backend in filter(None, args.backends.split(",")):
        for kind, model in (("llama_padded", "llama"), ("llama_packed", "llama"), ("gemma3_images", "gemma3")):
            key = f"{backend}/{kind}"
            try:
                res["cases"][key] = check(models[model], kind, backend, args.seq, args.device)
            except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                res["cases"][key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(key, json.dumps(res["cases"][key], default=str), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(res, indent=1, default=str))
            if os.environ.get("OUT"):
                Path(os.environ["OUT"], out.name).write_text(json.dumps(res, indent=1, default=str))
    print("wrote", out)


if __name__ == "__main__":
    main()
