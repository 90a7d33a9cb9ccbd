"""variantgen inside Hugging Face transformers on the CPU, through the flex route.

Tiny randomly initialised models built from configs (nothing is downloaded): a Llama-style
model (causal; packed documents) and a Gemma 3 style multimodal one (image tokens marked by
``token_type_ids``, sliding-window and global layers). Each test runs transformers' own sdpa
path and then the same model attached to variantgen on the same inputs, and compares the
logits (max abs difference and argmax agreement, asserted and printed) of a forward pass and
the tokens and scores of a short greedy generate().
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install transformers==5.17.0; see scripts/setup.sh)")

from variantgen.integrations import transformers as vg_hf  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def llama(dtype=torch.float32, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def gemma3():
    tc = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=16, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vc = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=tc, vision_config=vc, mm_tokens_per_image=4, image_token_index=120,
                                    boi_token_index=121, eoi_token_index=122, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(cfg).eval()


def compare(label, out, ref, valid, record, atol=1e-4, agree=1.0):
    """Logits of the attached model vs transformers' own on the rows that are real tokens."""
    diff = (out.float() - ref.float())[valid].abs().max().item()
    agreement = (out.argmax(-1) == ref.argmax(-1))[valid].float().mean().item()
    print(f"{label}: max abs diff {diff:.3e}, argmax agreement {agreement:.4f}")
    record(f"{label} max_abs_diff", diff)
    record(f"{label} argmax_agreement", agreement)
    assert diff <= atol and agreement >= agree, f"{label}: max abs diff {diff:.3e}, argmax agreement {agreement}"


def generate(model, **inputs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=5, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)


def compare_generate(label, gen, ref, record):
    assert torch.equal(gen.sequences, ref.sequences), f"{label}: greedy tokens differ"
    diff = max((a - b).abs().max().item() for a, b in zip(gen.scores, ref.scores))
    print(f"{label}: greedy tokens equal, max abs score diff {diff:.3e}")
    record(f"{label} max_abs_score_diff", diff)
    assert diff <= 1e-4


@pytest.mark.parametrize("prefill_kind", ["ragged", "prefill"])
def test_llama_padded_batch_forward_and_generate(prefill_kind, record_property):
    """A left-padded batch: prefill through the ragged (or paged) kind, generation steps through
    decode (the padded row's keys copied into pages of one token)."""
    model = llama()
    ids = torch.randint(0, 128, (3, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    mask[2, :1] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    ref_gen = generate(model, input_ids=ids, attention_mask=mask)
    report = vg_hf.attach(model, backend="flex", prefill_kind=prefill_kind)
    assert report.ok and model.config._attn_implementation == "variantgen", str(report)
    assert report.routes[("causal", prefill_kind)] == "ok (flex)"
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
    compare(f"llama {prefill_kind} forward", out, ref, mask.bool(), record_property)
    compare_generate(f"llama {prefill_kind} generate", generate(model, input_ids=ids, attention_mask=mask), ref_gen,
                     record_property)
    assert report.calls[f"causal/{prefill_kind}"] == 4 and report.calls["causal/decode"] == 8
    assert not [k for k in report.calls if k.startswith("fallback")], report.calls


def test_llama_unpadded_generate_reads_the_cache_as_pages(record_property):
    """No padding: each decode step reads the model's cache as one HND page per request."""
    model = llama()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    ref_gen = generate(model, input_ids=ids)
    report = vg_hf.attach(model, backend="flex")
    compare_generate("llama unpadded generate", generate(model, input_ids=ids), ref_gen, record_property)
    decode = report_route(model, "causal", "decode").wrappers[()]  # the causal spec has no scalars
    assert decode._batch.page_size == 9 + 4  # the last step's cache length: one page per request
    assert report.calls["causal/decode"] == 8


def report_route(model, spec, kind):
    return getattr(model, vg_hf.SESSION_ATTR).routes[(spec, kind)]


def test_packed_documents_map_to_the_document_spec(record_property):
    """Position ids restarting inside a row (no padding mask, no cache): documents do not see
    each other - transformers' packed-sequence mask, here the document spec's doc_ids."""
    model = llama()
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    pos = torch.stack([torch.cat([torch.arange(10), torch.arange(15), torch.arange(5)]),
                       torch.cat([torch.arange(4), torch.arange(26)])])
    with torch.no_grad():
        ref = model(ids, position_ids=pos, use_cache=False).logits
        plain = model(ids, use_cache=False).logits
    assert (ref - plain).abs().max() > 1e-2  # the documents matter
    report = vg_hf.attach(model, backend="flex")
    with torch.no_grad():
        out = model(ids, position_ids=pos, use_cache=False).logits
    compare("llama packed documents", out, ref, torch.ones(2, 30, dtype=torch.bool), record_property)
    assert report.calls["document/ragged"] == 2


def test_gemma3_image_tokens_and_sliding_layers(record_property):
    """Gemma 3: runs of image tokens (token_type_ids == 1) are bidirectional blocks, on global
    layers OR causal, on sliding ones AND the window: mm_prefix with each image query's block as
    its span; generation steps (text) through the causal and sliding-window decode routes."""
    model = gemma3()
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 100, (2, 24), generator=gen)
    tt = torch.zeros_like(ids)
    tt[:, 5:9] = 1
    tt[1, 14:18] = 1
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    inputs = dict(input_ids=ids, token_type_ids=tt, attention_mask=mask)
    with torch.no_grad():
        ref = model(**inputs).logits
        text_only = model(input_ids=ids, attention_mask=mask).logits
    assert (ref - text_only)[mask.bool()].abs().max() > 1e-3  # the image blocks matter
    ref_gen = generate(model, **inputs)
    report = vg_hf.attach(model, backend="flex")
    assert report.ok and model.config.text_config._attn_implementation == "variantgen", str(report)
    assert model.config.vision_config._attn_implementation == "sdpa"  # the vision tower keeps its own
    with torch.no_grad():
        out = model(**inputs).logits
    compare("gemma3 images forward", out, ref, mask.bool(), record_property)
    compare_generate("gemma3 images generate", generate(model, **inputs), ref_gen, record_property)
    assert getattr(model, vg_hf.SESSION_ATTR).inputs == {}  # forgotten after the forward
    route = report_route(model, "mm_prefix", "ragged")
    assert len(route.wrappers) == 2  # global and sliding layers: one wrapper per set of windows
    assert report.calls["mm_prefix/ragged"] == 6 and report.calls["sliding_window/decode"] == 8
    assert report.calls["causal/decode"] == 4


def test_calls_no_route_serves_run_transformers_own(record_property):
    """Padding inside a sequence maps to no request: that call runs sdpa with sdpa's mask (built
    then), so the result is transformers' own, and the report counts the reason."""
    model = llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, 4:6] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    report = vg_hf.attach(model, backend="flex")
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
    assert torch.equal(out, ref)
    assert report.calls["fallback: padding inside a sequence (each row's real tokens must be one run)"] == 2


def test_a_backend_that_cannot_run_here_keeps_the_model_as_it_was():
    """fa2 on a machine without a GPU: every probe says why; the model keeps sdpa."""
    model = llama()
    report = vg_hf.attach(model, backend="fa2")
    assert not report.ok and model.config._attn_implementation == "sdpa"
    assert all(status.startswith("no: ") for status in report.routes.values()), str(report)
    assert "keeps sdpa" in str(report)


def test_detach_restores_the_model():
    model = llama()
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        ref = model(ids).logits
    vg_hf.attach(model, backend="flex")
    vg_hf.detach(model)
    assert model.config._attn_implementation == "sdpa" and not hasattr(model, vg_hf.SESSION_ATTR)
    assert not model._forward_pre_hooks and not model._forward_hooks
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_bf16_model(record_property):
    """A bf16 model: the two implementations round differently, so the tolerance is bf16's."""
    model = llama(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(ids).logits
    vg_hf.attach(model, backend="flex")
    with torch.no_grad():
        out = model(ids).logits
    compare("llama bf16 forward", out, ref, torch.ones(2, 33, dtype=torch.bool), record_property, atol=0.05,
            agree=0.95)


def test_unattached_model_using_the_name_is_told_what_to_do():
    vg_hf.register()
    model = llama()
    model.set_attn_implementation("variantgen")
    with pytest.raises(RuntimeError, match="call variantgen.integrations.transformers.attach"), torch.no_grad():
        model(torch.randint(0, 128, (1, 5)))
