"""Config validation (issue #41): every numeric field has a range checked when config.json is parsed,
before any weight is read or anything compiles; the error is one short line naming the field, the
value and the range, whatever the input's size. No model is built or compiled here."""
import dataclasses
import json
import math
import re
import time

import pytest

from jaxspec import models
from jaxspec.models import presets
from jaxspec.models.config import FULL, SLIDING
from support.seeds import seeded_rng

S, F = SLIDING, FULL
MAX_MSG = 300  # the bound on an error's length
ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "factor")


def refused(make, *names, exc=ValueError):
    """The error `make()` raises: of type `exc`, one line, at most MAX_MSG chars, naming each of
    `names`, and raised fast (no work proportional to a huge input's size)."""
    t0 = time.perf_counter()
    with pytest.raises(exc) as e:
        make()
    msg = str(e.value)
    assert time.perf_counter() - t0 < 2.0, "the check did work proportional to the input"
    assert "\n" not in msg and len(msg) <= MAX_MSG, (len(msg), msg[:400])
    for n in names:
        assert n in msg, (n, msg)
    return msg


def target(**edit):
    return models.TargetConfig.from_dict(presets.tiny_target_dict(**edit))


def rope(kind, **edit):
    """tiny_target_dict's rope_parameters with `edit` applied to layer type `kind`'s entry."""
    r = {k: dict(v) for k, v in presets.tiny_target_dict()["rope_parameters"].items()}
    r[kind].update(edit)
    return r


# ---- cases 1 and 2: degenerate values are refused when the config is parsed ------------------------
def _degenerate(rng):
    """(config edit, the field the error must name, the bad value it must show)."""
    neg = -float(rng.uniform(1e-6, 1e3))  # a fresh negative number
    big = float(rng.uniform(1.5, 9))
    cases = [
        # case 1: a cap of 0 made every logit 0 (NaN on device): all-pad output, exit 0
        ("final_logit_softcapping", 0.0), ("final_logit_softcapping", neg),
        ("final_logit_softcapping", 1e-40),  # 0 in float32
        ("final_logit_softcapping", 1e300),  # inf in float32
        # case 2: these were found only as "non-finite weights" after loading and compiling
        ("rms_norm_eps", neg), ("rms_norm_eps", 0.0), ("rms_norm_eps", big),
        ((S, "rope_theta"), 0.0), ((F, "rope_theta"), neg), ((S, "rope_theta"), 1e-50),
        ((F, "partial_rotary_factor"), 0.0), ((F, "partial_rotary_factor"), big),
        ((F, "factor"), 0.0), ((F, "factor"), neg),
        # sizes the model cannot run with
        ("sliding_window", 0), ("sliding_window", int(neg) - 1), ("vocab_size", 0),
        ("hidden_size", int(neg) - 1), ("intermediate_size", 0), ("num_attention_heads", 0),
        ("num_hidden_layers", 0), ("num_hidden_layers", 5000), ("num_kv_shared_layers", -1),
        ("num_global_key_value_heads", 0), ("global_head_dim", 0), ("head_dim", 3),
        ("eos_token_id", 256),  # the tiny vocabulary has ids 0..255
        ("eos_token_id", [1, int(neg) - 1]), ("max_position_embeddings", int(neg) - 1),
    ]
    for field, value in cases:
        if isinstance(field, tuple):
            yield dict(rope_parameters=rope(field[0], **{field[1]: value})), field[1], value
        elif field == "num_hidden_layers":
            yield dict(num_hidden_layers=value, layer_types=[F] * value), field, value
        elif field == "num_global_key_value_heads":
            yield dict(num_global_key_value_heads=value, attention_k_eq_v=True), field, value
        else:
            yield {field: value}, field, value


def test_degenerate_values_are_refused_when_parsed():
    for edit, field, value in _degenerate(seeded_rng()):
        msg = refused(lambda: target(**edit), field)
        shown = value[-1] if isinstance(value, list) else value
        assert repr(shown)[:10] in msg, msg  # the value is shown
        assert re.search(r"[\[(][^,]+, [^\])]+[\])]|one of|even", msg), msg  # and what is allowed


@pytest.mark.parametrize("field", ["rms_norm_eps", "final_logit_softcapping", "sliding_window",
                                   "num_hidden_layers", "vocab_size"])
def test_configs_built_directly_are_checked_too(field):
    """The dataclasses check themselves: a config made with dataclasses.replace is refused the same way."""
    cfg = target()
    bad = {"rms_norm_eps": -1e-6, "final_logit_softcapping": 0.0, "sliding_window": 0,
           "num_hidden_layers": 0, "vocab_size": -3}[field]
    refused(lambda: dataclasses.replace(cfg, **{field: bad}), field)


def test_rope_config_checks_itself():
    refused(lambda: models.config.RopeConfig("default", theta=0.0), "theta")
    refused(lambda: models.config.RopeConfig("proportional", theta=1e4, partial_rotary_factor=2.0),
            "partial_rotary_factor")


def test_bad_config_is_reported_before_any_weight_is_read(tmp_path):
    """load_target and the CLI's config check name the field; before, a directory with this config and
    no weights got past the config (to "no safetensors files"), and with weights to NaN after ~11 s."""
    from jaxspec.cli import UsageError, _parse_configs
    eps = -float(seeded_rng().uniform(1e-7, 1e-3))
    (tmp_path / "config.json").write_text(json.dumps(presets.tiny_target_dict(rms_norm_eps=eps)))
    refused(lambda: models.load_target(str(tmp_path)), "rms_norm_eps", repr(eps)[:10])
    refused(lambda: _parse_configs(str(tmp_path), None), "rms_norm_eps", exc=UsageError)


# ---- case 3: errors stay one short line whatever the input's size ----------------------------------
BIG = 200_000
HUGE_STR = "x" * 10_000_000
HUGE_INT = 10 ** 5000  # repr() of it raises in Python >= 3.11


@pytest.mark.parametrize("edit, field", [
    (dict(num_hidden_layers=BIG, layer_types=[S] * (BIG - 1) + [F]), "num_hidden_layers"),
    (dict(num_hidden_layers=HUGE_INT), "num_hidden_layers"),  # before: repr() of it raised, unnamed
    (dict(num_hidden_layers=10 ** 7, layer_types=None), "num_hidden_layers"),  # before: built 10**7 layers
    (dict(layer_types=[S] * BIG), "layer_types"),
    (dict(num_hidden_layers=BIG, layer_types=[f"t{i}" for i in range(BIG)]), "num_hidden_layers"),
    (dict(layer_types=[S, F, S, f"{HUGE_STR}"]), "layer_types"),
    (dict(layer_types=HUGE_STR), "layer_types"),
    (dict(model_type=HUGE_STR), "model_type"),
    (dict(hidden_activation=HUGE_STR), "hidden_activation"),
    (dict(vocab_size=HUGE_INT), "vocab_size"),
    (dict(vocab_size=HUGE_STR), "vocab_size"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(vocab_size=True), "vocab_size"),
    (dict(sliding_window=float("nan")), "sliding_window"),
    (dict(rms_norm_eps=HUGE_INT), "rms_norm_eps"),  # float() of it overflows
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps"),
    (dict(final_logit_softcapping=False), "final_logit_softcapping"),
    (dict(tie_word_embeddings=HUGE_STR), "tie_word_embeddings"),
    (dict(eos_token_id=list(range(BIG))), "eos_token_id"),
    (dict(eos_token_id=HUGE_STR), "eos_token_id"),
    (dict(rope_parameters={f"k{i}": {} for i in range(BIG)}), "rope_parameters"),
    (dict(rope_parameters={S: {"rope_type": HUGE_STR, "rope_theta": 1e4}}), "rope_type"),
    (dict(rope_parameters={S: {"rope_theta": HUGE_INT}}), "rope_theta"),
    (dict(rope_parameters=HUGE_STR), "rope_parameters"),
    (dict(per_layer_config={str(i): {"head_dim": 8} for i in range(BIG)}), "per_layer_config"),
    (dict(per_layer_config={HUGE_STR: {"head_dim": 8}}), "per_layer_config"),
    (dict(per_layer_config={"1": {f"k{i}": 1 for i in range(BIG)}}), "per_layer_config"),
    (dict(per_layer_config={"1": {"head_dim": HUGE_INT}}), "head_dim"),
    (dict(max_position_embeddings=HUGE_STR), "max_position_embeddings"),
])
def test_huge_or_malformed_values_give_one_short_line(edit, field):
    # unsupported features (a RoPE type, an activation, overriding other keys) stay NotImplementedError
    unsupported = field in ("rope_type", "hidden_activation") or len(edit.get("per_layer_config", {}).get("1", {})) > 1
    refused(lambda: target(**edit), field, exc=NotImplementedError if unsupported else ValueError)


def test_assistant_fields_are_checked():
    rng = seeded_rng()
    a = presets.tiny_assistant_dict
    refused(lambda: models.AssistantConfig.from_dict(a(backbone_hidden_size=-int(rng.integers(1, 99)))),
            "backbone_hidden_size")
    refused(lambda: models.AssistantConfig.from_dict(a(backbone_hidden_size=HUGE_INT)), "backbone_hidden_size")
    refused(lambda: models.AssistantConfig.from_dict(a(num_centroids=HUGE_STR)), "num_centroids")
    refused(lambda: models.AssistantConfig.from_dict(a(text=dict(rms_norm_eps=0.0))), "rms_norm_eps")
    refused(lambda: models.AssistantConfig.from_dict(a(model_type=HUGE_STR)), "model_type")
    n = 4000  # within the layer bound: check_fit once listed every layer (a 96 MB line at 200,000 layers)
    big = models.AssistantConfig.from_dict(a(text=dict(num_hidden_layers=n, num_kv_shared_layers=n,
                                                       layer_types=[S] * (n - 1) + [F], head_dim=8)))
    msg = refused(lambda: models.check_fit(big, target()), "head_dim")
    assert re.search(r"\d+ more", msg), msg  # says how many problems it left out


# ---- what is valid still parses, and round-trips -------------------------------------------------
def _random_sane_dict(rng) -> dict:
    """A random config inside every documented range (tiny sizes so nothing big is made)."""
    n = int(rng.integers(1, 13))
    kv = int(rng.integers(1, 5))
    types = [S if rng.random() < 0.7 else F for _ in range(n - 1)] + [F]
    shared = int(rng.integers(0, n)) if S in types[: max(1, n // 2)] and n > 1 else 0
    first = n - shared
    if shared and set(types[first:]) - set(types[:first]):
        shared = 0
    return presets.tiny_target_dict(
        vocab_size=int(rng.integers(8, 5000)), hidden_size=int(rng.integers(1, 300)),
        intermediate_size=int(rng.integers(1, 900)), num_hidden_layers=n, layer_types=types,
        num_attention_heads=kv * int(rng.integers(1, 5)), num_key_value_heads=kv,
        head_dim=2 * int(rng.integers(1, 65)), global_head_dim=2 * int(rng.integers(1, 129)),
        num_global_key_value_heads=kv, attention_k_eq_v=bool(rng.random() < 0.5),
        sliding_window=int(rng.integers(1, 5000)), num_kv_shared_layers=shared,
        rms_norm_eps=float(10 ** rng.uniform(-12, 0)),
        final_logit_softcapping=None if rng.random() < 0.3 else float(rng.uniform(0.5, 1e3)),
        rope_parameters={S: {"rope_type": "default", "rope_theta": float(10 ** rng.uniform(0, 12))},
                         F: {"rope_type": "proportional", "rope_theta": float(10 ** rng.uniform(0, 12)),
                             "partial_rotary_factor": float(1 - rng.uniform(0, 1 - 1e-9)),
                             "factor": float(10 ** rng.uniform(-3, 3))}},
        max_position_embeddings=int(rng.integers(1, 1 << 20)),
        eos_token_id=[int(x) for x in rng.integers(0, 8, size=int(rng.integers(1, 4)))],
    )


def test_random_sane_configs_parse_and_round_trip():
    rng = seeded_rng()
    for _ in range(200):
        d = _random_sane_dict(rng)
        cfg = models.TargetConfig.from_dict(d)
        assert models.TargetConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
        assert cfg.rms_norm_eps == d["rms_norm_eps"] and cfg.sliding_window == d["sliding_window"]
        assert cfg.rope_full.factor == d["rope_parameters"][F]["factor"]
        ad = presets.tiny_assistant_dict(d, text=dict(num_hidden_layers=1, num_kv_shared_layers=1,
                                                      layer_types=[F], rms_norm_eps=d["rms_norm_eps"],
                                                      num_attention_heads=d["num_attention_heads"]))
        acfg = models.AssistantConfig.from_dict(ad)
        assert models.AssistantConfig.from_dict(json.loads(json.dumps(acfg.to_dict()))) == acfg
        models.check_fit(acfg, cfg)


def test_the_bounds_themselves_are_allowed():
    """Each documented range's ends (inclusive ones) parse: the check is not off by one."""
    r = models.config.FIELD_RANGES
    lo_hi = {name: spec for name, spec in r.items()}
    edits = [dict(num_hidden_layers=lo_hi["num_hidden_layers"].hi, layer_types=None),
             dict(num_hidden_layers=1, layer_types=[F]),
             dict(rms_norm_eps=lo_hi["rms_norm_eps"].hi),
             dict(final_logit_softcapping=lo_hi["final_logit_softcapping"].hi),
             dict(sliding_window=lo_hi["sliding_window"].hi),
             dict(rope_parameters=rope(F, partial_rotary_factor=1.0)),
             dict(rope_parameters=rope(S, rope_theta=lo_hi["rope_theta"].hi))]
    for edit in edits:
        target(**edit)
    assert math.isfinite(lo_hi["rope_theta"].hi)


@pytest.mark.parametrize("name", ["tiny", "e2b", "e4b", "12b", "31b"])
def test_presets_pass(name):
    tcfg, acfg = presets.target_config(name), presets.assistant_config(name)
    models.check_fit(acfg, tcfg)
    assert models.TargetConfig.from_dict(tcfg.to_dict()) == tcfg


# ---- the quantization section (read by checkpoint loading; the check lives with the config rules) -
def test_quantization_section_is_checked():
    qf = models.config.quantization_format
    rng = seeded_rng()
    bits, gs = int(rng.choice([2, 4, 8])), int(rng.choice([32, 64, 128]))
    good = {"bits": bits, "group_size": gs, "model.layers.0.mlp.up_proj": {"bits": 8, "group_size": 32}}
    assert qf({"quantization": good}) is good and qf({}) is None
    refused(lambda: qf({"quantization": {"bits": 3, "group_size": gs}}), "quantization.bits", "3")
    refused(lambda: qf({"quantization": {"bits": bits, "group_size": float("nan")}}), "quantization.group_size")
    refused(lambda: qf({"quantization": {"bits": HUGE_INT}}), "quantization.bits")
    refused(lambda: qf({"quantization": {"bits": bits, HUGE_STR: {"bits": True}}}), "bits", "True")
    refused(lambda: qf({"quantization": HUGE_STR}), "quantization")
    refused(lambda: qf({"quantization": {"bits": 4, "mode": HUGE_STR}}), "mode", exc=NotImplementedError)
    refused(lambda: qf({"quantization_config": {"quant_method": HUGE_STR}}), "quantization_config",
            exc=NotImplementedError)


def test_check_fit_names_arguments_of_the_wrong_kind():
    """check_fit(assistant, target) with configs swapped, the same kind twice or a dict: a TypeError
    naming the argument and what it got, not an AttributeError from inside (issue 51)."""
    tcfg, acfg = target(), models.AssistantConfig.from_dict(presets.tiny_assistant_dict())
    for args, bad in (((tcfg, tcfg), "assistant"), ((acfg, acfg), "target"), ((tcfg, acfg), "assistant"),
                      ((acfg, presets.tiny_target_dict()), "target")):
        with pytest.raises(TypeError, match=rf"check_fit\(assistant, target\): {bad} must be an? "
                                            rf"{'AssistantConfig' if bad == 'assistant' else 'TargetConfig'}, "
                                            rf"got {type(args[bad == 'target']).__name__}"):
            models.check_fit(*args)
    models.check_fit(acfg, tcfg)
