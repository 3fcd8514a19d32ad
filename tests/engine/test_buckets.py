"""Size buckets (loop_config.size_bucket): after a first run, new --max-tokens values and prompt lengths
compile a prefill and a decode only for a power-of-two bucket not seen before (the real 270M pays
20-26 s on a 2-core CPU for each program; with 32-token budget and 16-token prompt buckets 48, 80, 100
and 128 new tokens or 129, 150 and 200 prompt tokens each compiled anew). Counted by CompileLog."""
import jaxspec
from jaxspec.engine import compile_cache
from jaxspec.models import presets
from support.pairs import XLA
from support.seeds import seeded_rng


def pow2_bucket(n, floor):
    """The documented rule below 1024: the smallest of floor, 2 floor, 4 floor, ... that holds n."""
    b = floor
    while b < n:
        b *= 2
    return b


def test_new_budgets_and_prompt_lengths_compile_once_per_power_of_two_bucket():
    target, _ = presets.tiny_pair(seed=int(seeded_rng().integers(1 << 16)), context=512, target_layers=1,
                                  matmul=XLA)
    rng = seeded_rng()
    prompts = {n: rng.integers(3, target.config.vocab_size, n).tolist() for n in (20, 129, 150, 200)}

    def run(prompt_len, budget):
        out = jaxspec.generate(target, prompts[prompt_len], max_new_tokens=budget, eos_token_ids=())
        assert len(out.tokens[0]) == budget  # the asked budget, whatever the bucket's buffer
        return out

    run(20, 48)  # the first run: a prefill and a decode for its buckets
    seen = {(pow2_bucket(20, 16), pow2_bucket(48, 32))}
    runs = [(20, 100), (20, 128), (20, 80), (200, 128), (150, 100), (129, 65), (20, 48)]
    with compile_cache.CompileLog() as log:
        for p, n in runs:
            run(p, n)
    new = {(pow2_bucket(p, 16), pow2_bucket(n, 32)) for p, n in runs} - seen
    assert new == {(32, 128), (256, 128)}
    built = [name for name in log.names() if name in ("prefill", "decode")]
    assert sorted(built) == sorted(["prefill", "decode"] * len(new)), [(p.name, p.compile_s) for p in log.compiled]
