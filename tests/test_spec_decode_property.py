"""Random workloads with speculative decoding on (chapter 17), on the tiny model: the block invariants after every
step, the liveness bound, no leaked block, and every output token-identical to the request run alone without
speculation (test_engine_property's oracle). Some prompts repeat a pattern, so drafts are proposed, accepted and
rejected; the profiles are test_engine_property's (120 derandomized examples in CI, 2,000 with ``long``)."""

from hypothesis import given, strategies as st

from test_engine_property import PROPERTY, check_workload, workloads


@st.composite
def speculative_workloads(draw):
    w = draw(workloads())
    low = draw(st.integers(1, 3))
    w["speculative_config"] = {"method": "ngram", "num_speculative_tokens": draw(st.integers(1, 5)),
                               "prompt_lookup_min": low, "prompt_lookup_max": draw(st.integers(low, 4))}
    requests = []
    for rid, prompt, params in w["requests"]:
        if draw(st.booleans()):  # the same length (the pool and budget were sized for it), repeating a pattern
            pattern = prompt[:draw(st.integers(1, 4))]
            prompt = (pattern * len(prompt))[:len(prompt)]
        requests.append((rid, prompt, params))
    w["requests"] = requests
    return w


@PROPERTY
@given(speculative_workloads())
def test_random_workloads_with_speculation(w):
    check_workload(w)
