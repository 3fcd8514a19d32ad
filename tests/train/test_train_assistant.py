"""jaxspec.train.assistant end to end on a tiny target: `main()` trains a drafter for a few hundred
steps on the target's greedy continuations, saves it (no embedding table of its own) and the tests
load it back. Independent references: the untrained drafter of the same config (acceptance), classic
decoding (greedy parity), a second tiny target (the refusal)."""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from jaxspec.train import assistant as ta
from jaxspec.train.shared import init_params
from jaxspec.models import presets
from jaxspec.models.checkpoint import SHARED_EMBEDDING
from support.seeds import seeded_int

STEPS = 240


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    seed = seeded_int(1 << 20)
    root = tmp_path_factory.mktemp("drafter")
    target, _ = presets.tiny_pair(seed, dtype=jnp.float32)
    models.save(target, str(root / "target"))
    out, work = str(root / "out"), str(root / "work")
    rc = ta.main(["--target", str(root / "target"), "--target-name", "tiny", "--out", out, "--work", work,
                  "--random-prompts", "--prompts", "96", "--prompt-tokens", "16", "--new-tokens", "32",
                  "--gen-batch", "32", "--batch", "8", "--steps", str(STEPS), "--ffn", "128", "--centroids", "32",
                  "--top-k", "4", "--warmup", "20", "--eval-prompts", "4", "--seed", str(seed % 1000),
                  # all 96 rows whatever the machine's load: the generation's time cap (120 s by default)
                  # would otherwise cut the data, and the drafter with it, on a slow CI worker
                  "--gen-seconds", "3600", "--minutes", "30", "--no-eval"])
    assert rc == 0
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    z = np.load(os.path.join(work, "data.npz"))
    prompts = [list(map(int, r)) for r in json.loads(str(z["eval_prompts"]))]
    return dict(target=target, out=out, metrics=metrics, prompts=prompts, rows=z["rows"], seed=seed)


@pytest.mark.slow
def test_heldout_loss_falls_and_layout(trained):
    tr = trained["metrics"]["training"]
    assert tr["steps"] == STEPS and tr["finished"]
    first, last = tr["heldout_loss"][0][1], tr["heldout_loss"][-1][1]
    assert last < 0.6 * first, tr["heldout_loss"]
    with open(os.path.join(trained["out"], "config.json")) as f:
        cfg = json.load(f)
    assert cfg["target"] == "tiny" and cfg["shared_embedding"] == SHARED_EMBEDDING
    assert set(cfg["target_fingerprint"]) == {"config_sha256", "embed_rows", "embed_sample"}
    assert os.path.isfile(os.path.join(trained["out"], "NOTICE"))
    from safetensors import safe_open
    with safe_open(os.path.join(trained["out"], "model.safetensors"), framework="numpy") as f:
        keys = list(f.keys())
    assert not any("embed_tokens" in k for k in keys) and "masked_embedding.token_ordering" in keys
    # the held-out prompts were never training rows
    held = {tuple(p) for p in trained["prompts"]}
    assert not any(tuple(r[:16]) in held for r in trained["rows"])


@pytest.mark.slow
def test_trained_drafter_beats_untrained_with_greedy_parity(trained):
    target = trained["target"]
    drafter = models.load_assistant(trained["out"], target=target, dtype=jnp.float32)
    assert drafter.params["embed_tokens"] is target.params["embed_tokens"]  # shared, not copied
    acfg = drafter.config
    p0 = init_params(ta.trainable_shapes(acfg), jax.random.PRNGKey(trained["seed"]), acfg.text.num_hidden_layers)
    untrained = ta.to_assistant(acfg, p0, {"embed_tokens": target.params["embed_tokens"]},
                                drafter.params["masked_embedding.token_ordering"], jnp.float32)
    prompts = trained["prompts"][:3]
    good = ta.acceptance_stats(target, drafter, prompts, 24)
    bad = ta.acceptance_stats(target, untrained, prompts, 24)
    assert good["all_identical"] and bad["all_identical"], (good["per_prompt"], bad["per_prompt"])
    assert all(p["mode"] != "classic" for p in good["per_prompt"])
    assert good["tokens_per_round"] > bad["tokens_per_round"] + 0.3, (good, bad)
    assert good["per_position_acceptance"][0] > bad["per_position_acceptance"][0]
    # --minutes bounds the evaluation: past its end no prompt is started (the one running finishes)
    late = ta.acceptance_stats(target, drafter, prompts, 24, end_by=time.time())
    assert (late["prompts"], late["skipped_for_time"]) == (0, 3) and good["skipped_for_time"] == 0


@pytest.mark.slow
def test_refuses_another_target(trained):
    other, _ = presets.tiny_pair(trained["seed"] + 1, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"was trained for target 'tiny', not this one: .*embedding table differs"):
        models.load_assistant(trained["out"], target=other)
    with pytest.raises(ValueError, match="pass target= the models.Target"):
        models.load_assistant(trained["out"], target=other.config)


@pytest.mark.slow
def test_self_written_prompts(trained):
    """self_prompts: BOS then the target's own samples, one row per sample, rows holding a bad id
    dropped. At temperature 0 every row is classic greedy decoding of [BOS] (the independent
    reference), and a bad id that greedy text holds empties the pool."""
    target, bos = trained["target"], 2
    rows = ta.self_prompts(target, bos, 10, 8, 4, 1.0, trained["seed"] % 1000, bad_ids=(1,))
    assert rows.shape == (10, 8) and (rows[:, 0] == bos).all() and not (rows[:, 1:] == 1).any()
    assert len({tuple(r) for r in rows}) > 5  # the batch's rows are different samples
    import jaxspec
    greedy = jaxspec.generate(target, [bos], max_new_tokens=7, block_size=1, eos_token_ids=[]).tokens[0]
    cold = ta.self_prompts(target, bos, 4, 8, 4, 0.0, 1)
    assert [r.tolist() for r in cold] == [[bos] + greedy] * 4
    with pytest.raises(RuntimeError, match="only 0 of 4 self-written prompts"):
        ta.self_prompts(target, bos, 4, 8, 4, 0.0, 1, bad_ids=(greedy[3],))
    # the data's deadline: past it, no batch is drawn after one that kept rows
    late = ta.self_prompts(target, bos, 10, 8, 4, 1.0, trained["seed"] % 1000, bad_ids=(1,), end_by=time.time())
    assert 1 <= len(late) <= 4 and late.shape[1] == 8 and (late[:, 0] == bos).all()  # one batch of 4, not 10 rows
