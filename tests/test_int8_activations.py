"""``quantization="gguf"`` with 8-bit activations (the default, llama.cpp's arithmetic; chapter 18) against the same
engine with float32 activations (exact to the float32 weights): rounding the rows changes the logits, so only what
the rounding's bound makes certain is asserted, and how many leading tokens agree is reported, not asserted."""

import pytest
import torch

from minivllm import LLM, EngineConfig, SamplingParams, kernels
from minivllm.bench.peers import leading_agreement
from minivllm.kernels import reference
from minivllm.simple_generation import chat_prompt_ids

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a hash table is in two sentences.", "List three prime numbers greater than ten."]


def test_gguf_activations_is_validated_and_reported():
    for bad in ("int4", None, 8):
        with pytest.raises(ValueError, match="^gguf_activations must be one of"):
            EngineConfig(model="smollm2-135m", quantization="gguf", gguf_activations=bad)
    with pytest.raises(ValueError, match=r'^gguf_activations must be "int8" \(the default\) unless quantization='):
        EngineConfig(model="smollm2-135m", gguf_activations="float32")
    assert EngineConfig(model="smollm2-135m").gguf_activations == "int8"


def lm_head_calls(llm):
    """Every call of ``llm``'s LM head as (its input rows, its logits)."""
    calls = []
    hook = llm.engine.model.lm_head.register_forward_hook(
        lambda module, args, out: calls.append((args[0].detach().clone(), out.detach().clone())))
    return calls, hook


def test_int8_activations_keep_each_first_token_the_rounding_bound_makes_certain():
    """The prompts' prefill (more than eight rows) runs the float32 copy in both engines, so the LM head gets the
    same hidden rows; only it rounds them to 8 bits for the first token. reference.int8_rounding_bound (plus both
    kernels' float32 rounding) bounds how far each logit moves: the bound holds on every logit, and wherever the
    float32 engine's top logit leads every other by more than the two logits' bounds, the 8-bit engine picks the
    same first token. Later tokens run every layer on 8-bit rows: their agreement is printed, not asserted."""
    if kernels.cpu_table() is None:
        pytest.skip("quantization='gguf' runs the C++ kernels, which do not build here")
    options = dict(num_blocks=96, max_num_seqs=4, device="cpu", dtype="float32")
    exact = LLM("smollm2-135m", quantization="gguf", gguf_activations="float32", **options)
    int8 = LLM("smollm2-135m", quantization="gguf", **options)
    assert exact.engine.stats().gguf_dot == "float32"
    assert int8.engine.stats().gguf_dot == f"q8_1 {kernels.cpu_table().int8_dot_kind}"
    prompts = [{"prompt_token_ids": chat_prompt_ids(exact.get_tokenizer(), q)} for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for name, llm in (("float32", exact), ("int8", int8)):
        calls, hook = lm_head_calls(llm)
        try:
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            hook.remove()
        outputs[name + " first"] = calls[0]
    (hidden, want), (hidden8, got) = outputs["float32 first"], outputs["int8 first"]
    assert hidden.shape[0] == len(prompts) and torch.equal(hidden8, hidden)  # the same float32 prefill
    assert [row.argmax().item() for row in want] == [o[0] for o in outputs["float32"]]  # rows in request order

    head = exact.engine.model.lm_head
    weight, qweight = head.weight.detach(), head.qweight
    x = hidden.double().abs() @ weight.double().abs().T
    float32_sums = (weight.shape[1] + 8) * 2.0 ** -24 * x  # the float32-activation kernel's own rounding
    bound = (reference.int8_rounding_bound(hidden, weight) + reference.int8_dot_bound(hidden, qweight, "q8_0")
             + float32_sums)
    moved = (got.double() - want.double()).abs()
    assert (moved <= bound).all() and moved.max() > 0  # the bound holds, and the rounding does move the logits
    certain, margins = 0, []
    for r in range(len(prompts)):
        top = int(want[r].argmax())
        lead = want[r, top].double() - want[r].double()
        clear = (lead > bound[r, top] + bound[r]) | (torch.arange(want.shape[1]) == top)
        margins.append(f"{want[r].topk(2).values.diff().abs().item():.3f}/{2 * bound[r].max().item():.3f}")
        if bool(clear.all()):
            certain += 1
            assert outputs["int8"][r][0] == outputs["float32"][r][0]
    lead = leading_agreement(outputs["int8"], outputs["float32"])
    print(f"8-bit against float32 activations: first token certain by the bound on {certain} of {len(prompts)} "
          f"prompts (top-2 margin / twice the largest bound: {', '.join(margins)}); leading identical tokens "
          f"{lead} of {params.max_tokens}")
