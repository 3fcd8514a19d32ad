"""What `python -m jaxspec.train.assistant` checks before any heavy work: its flags, the target's
config, --out, the work folder (--work) and, with --resume, the run recorded there and its cached
arrays. Every mistake is a `UsageError`: one line on stderr and exit status 2 (train_assistant.main),
found in a second, not after the target loaded or minutes of data generation.

The work folder holds what the run loads back (its recipe in run.json, which --resume follows over
the flags; the prompts, greedy rows and checkpoints), so it must be the user's own: a directory
owned by this user that neither its group nor others can write, and that nobody else can replace
(its parent not writable by others, unless sticky as /tmp is). The default is under the user's cache
($XDG_CACHE_HOME or ~/.cache: jaxspec/drafter-work/<target name>), created 0700; a fixed name in a
shared /tmp let another user create it first and make a victim's --resume train their model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys

import numpy as np

RUN = "run.json"
CACHED = ("data.npz", "ordering.npz", "ckpt.npz")  # what a run writes into its work folder, beside RUN
# The flags a --resume call sets itself; every other one is the first call's (run.json).
THIS_CALL = ("resume", "minutes", "eval_reserve", "out", "work", "no_eval", "no_self_check", "eval_prompts",
             "stop_after", "eval_new_tokens")
AFTER_TRAIN_S = 20.0    # the run's end keeps this much beside the evaluation's reserve (the save)
MIN_DATA_TRAIN_S = 120.0  # --minutes must leave at least this for the data and the training


class UsageError(ValueError):
    """A mistake in the flags or in the files they name: one line on stderr, exit status 2."""


def one_line(e: BaseException | str, limit: int = 400) -> str:
    """The message on one line of at most `limit` characters (a longer one cut with a marker)."""
    s = " ".join(str(e).split()) or type(e).__name__
    return s if len(s) <= limit else f"{s[:limit - 40]} ... [{len(s) - limit + 40} more characters]"


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes are a UsageError (one line), not ~40 lines of usage."""

    def error(self, message):
        raise UsageError(f"{message} (--help lists the flags)")


def cli(prog: str, run, argv) -> int:
    """`run(argv)`'s exit status; a UsageError is one line on stderr and status 2 (the train commands' main)."""
    try:
        return run(argv)
    except UsageError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2


# ---- the flags ------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


# flag, integer?, lower bound, bound excluded?, upper bound, may be None (not given)
_RANGES = (
    ("--minutes", False, 0, True, None, False), ("--lr", False, 0, True, None, False),
    ("--weight-decay", False, 0, False, None, False), ("--cluster-weight", False, 0, False, None, False),
    ("--self-share", False, 0, False, 1, False), ("--self-temperature", False, 0, False, None, False),
    ("--gen-seconds", False, 0, True, None, False), ("--ckpt-seconds", False, 0, True, None, False),
    ("--eval-reserve", False, 0, False, None, True), ("--train-minutes", False, 0, True, None, True),
    ("--prompts", True, 1, False, None, False), ("--gen-batch", True, 1, False, None, False),
    ("--batch", True, 1, False, None, False), ("--prompt-tokens", True, 2, False, None, False),
    ("--new-tokens", True, 3, False, None, False),  # a query needs its 3 draft steps' labels
    ("--layers", True, 1, False, None, False), ("--ffn", True, 1, False, None, False),
    ("--centroids", True, 0, False, None, False), ("--top-k", True, 1, False, None, False),
    ("--steps", True, 1, False, None, True), ("--max-steps", True, 1, False, None, False),
    ("--stop-after", True, 1, False, None, True), ("--warmup", True, 0, False, None, False),
    ("--eval-prompts", True, 1, False, None, True), ("--eval-new-tokens", True, 1, False, None, False),
    ("--seed", True, 0, False, None, False), ("--max-files", True, 1, False, None, True),
    ("--bits", True, 0, False, 8, False),
)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def check_flags(args) -> None:
    """Every numeric flag's type and range (a run.json's values, on --resume, too): UsageError."""
    for flag, integer, lo, lo_open, hi, optional in _RANGES:
        v = getattr(args, _dest(flag))
        if v is None and optional:
            continue
        ok = _is_int(v) if integer else _is_num(v)
        if ok:
            ok = (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
        if not ok:
            kind = "an integer" if integer else "a number"
            rng = f"in [{lo}, {hi}]" if hi is not None else f"> {lo}" if lo_open else f">= {lo}"
            raise UsageError(f"{flag} must be {kind} {rng}, got {v!r}")
    if args.bits not in (0, 4, 8):
        raise UsageError(f"--bits must be 0, 4 or 8, got {args.bits!r}")
    for flag in ("--target", "--out"):
        if not isinstance(getattr(args, _dest(flag)), str) or not getattr(args, _dest(flag)):
            raise UsageError(f"{flag} must name a path, got {getattr(args, _dest(flag))!r}")


def check_recipe(args, tcfg, reserve: float) -> None:
    """The flags against each other and against the target's config (`tcfg`); `reserve`: the
    seconds the evaluation keeps at the end of --minutes (0 with --no-eval)."""
    if args.prompts < args.gen_batch:
        raise UsageError(f"--prompts {args.prompts} is fewer than --gen-batch {args.gen_batch}: the greedy data is "
                         "generated in whole batches, so no row would be made (raise --prompts or lower --gen-batch)")
    held = max(2 * args.batch, args.prompts // 50)  # the held-out loss's rows (train_assistant.main)
    if args.prompts - held < args.batch:
        raise UsageError(f"--prompts {args.prompts} leaves fewer than --batch {args.batch} training rows beside "
                         f"the {held} kept for the held-out loss (2 x --batch): raise --prompts or lower --batch")
    seq, context = args.prompt_tokens + args.new_tokens, tcfg.max_position_embeddings
    if context and seq > context:
        raise UsageError(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} = {seq} positions, "
                         f"past the target's context of {context}")
    v, c = tcfg.vocab_size, args.centroids
    if c and (c & (c - 1) or v % c):
        raise UsageError(f"--centroids {c} must be 0 (a full head) or a power of two dividing the target's "
                         f"vocabulary of {v}")
    fixed = reserve + AFTER_TRAIN_S
    if 60.0 * args.minutes < fixed + MIN_DATA_TRAIN_S:
        least = math.ceil((fixed + MIN_DATA_TRAIN_S) / 6.0) / 10.0
        raise UsageError(f"--minutes {args.minutes:g} is too short: the run keeps {fixed:.0f} s at its end for "
                         f"saving{' and evaluating (--eval-reserve)' if reserve else ''} and needs "
                         f"{MIN_DATA_TRAIN_S:.0f} s for its data and training: pass at least --minutes {least:g}"
                         + ("" if not reserve else " (or --no-eval, or a smaller --eval-reserve)"))


def target_config(arg: str):
    """The target's config, parsed from its config.json (every weight file checked to be a readable
    regular file) or a GGUF's header: nothing is loaded. UsageError naming --target."""
    from jaxspec import models
    from jaxspec.models import gguf
    from jaxspec.models.checkpoint_files import read_config

    try:
        src = gguf.source(arg)
        return models.TargetConfig.from_dict(gguf.plan(src)[3] if src is not None else read_config(arg)[0])
    except (ValueError, NotImplementedError) as e:
        hint = ""
        if not os.path.lexists(arg) and os.sep not in arg and not arg.endswith(".gguf"):
            hint = f" (a model name is one of: {', '.join(sorted(gguf.KNOWN))})"
        raise UsageError(f"--target {arg!r} is not a target jaxspec can load: {one_line(e, 300)}{hint}") from None


def tokenizer_of(arg: str):
    """The target's tokenizer (text prompts need it): its tokenizer.json, or its GGUF's; UsageError
    naming --target when there is none (--random-prompts needs none)."""
    from jaxspec.models import gguf
    from jaxspec.text import load_tokenizer

    try:
        return load_tokenizer(gguf.source(arg) or arg)
    except (ValueError, OSError) as e:  # TokenizerError is a ValueError
        why = one_line(e, 200).replace(" (pass --tokenizer FILE)", "")  # the CLI's flag, not one of ours
        raise UsageError(f"--target {arg!r} has no tokenizer to make text prompts with ({why}): pass "
                         "--random-prompts, or a target with one") from None


def check_name(name: str) -> None:
    """The target's name names folders (drafters/<name>, the default work folder): a plain name."""
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise UsageError(f"--target-name {name!r} must be a plain name (no '/'), e.g. gemma-3-270m")


def check_out(path: str) -> None:
    """--out: a directory, or a path one can be made at, that this user can write."""
    try:
        if os.path.lexists(path):
            st = os.stat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise UsageError(f"--out {path!r} exists and is not a directory")
            where = path
        else:
            where = os.path.dirname(os.path.abspath(path))
            while not os.path.lexists(where):
                where = os.path.dirname(where)
            if not os.path.isdir(where):
                raise UsageError(f"--out {path!r} cannot be made: {where!r} is not a directory")
    except OSError as e:  # a symlink loop, a dangling link
        raise UsageError(f"--out {path!r} cannot be used: {e.strerror or e}") from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path!r} cannot be written ({where!r} is not writable)")


def load_heldout(path: str | None, default: str) -> tuple[list[dict], str | None]:
    """(the held-out prompts, their file) from --heldout `path` (which must exist), else from
    `default` when that file exists, else ([], None). UsageError for a file that is not a
    {"prompts": [{"text": ...}, ...]} JSON object."""
    given = path is not None
    path = path if given else default
    if not os.path.isfile(path):
        if given:
            raise UsageError(f"--heldout {path!r} is not a file")
        return [], None
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"held-out prompts {path!r} cannot be read: {one_line(e, 200)}") from None
    prompts = d.get("prompts") if isinstance(d, dict) else None
    if not (isinstance(prompts, list) and prompts
            and all(isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"].strip() for p in prompts)):
        raise UsageError(f"held-out prompts {path!r} must be a JSON object whose \"prompts\" is a non-empty list of "
                         "{\"text\": ...} objects")
    return list(prompts), path


# ---- the work folder --------------------------------------------------------------------------------
def default_work(name: str) -> str:
    """The default --work: jaxspec/drafter-work/<name> in the user's cache ($XDG_CACHE_HOME, else ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxspec", "drafter-work", name)


def _not_own(path: str) -> str | None:
    """Why the work folder `path` (which exists) could hold or get what someone else wrote; None if
    it cannot: it must be a directory (not a link to one) owned by this user, not writable by its
    group or others, in a parent others cannot write (unless sticky, as /tmp)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link (name the directory itself)"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} (mode " \
               f"{stat.S_IMODE(st.st_mode):04o})"
    parent = os.path.dirname(os.path.abspath(path))
    pst = os.stat(parent)
    if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
        return (f"its folder {parent!r} is writable by others (mode {stat.S_IMODE(pst.st_mode):04o}), who could "
                "replace it")
    return None


def _refuse(path: str, why: str) -> UsageError:
    return UsageError(f"--work {path!r} is not yours alone: {why}; a run is loaded back from it (--resume follows "
                      "its run.json), so use a directory only you can write")


def check_work(path: str, resume: bool) -> None:
    """The work folder before anything is read from it: if it exists, the user's own (`_not_own`);
    with `resume`, holding a run."""
    try:
        why = _not_own(path) if os.path.lexists(path) else None
    except OSError as e:
        raise UsageError(f"--work {path!r} cannot be used: {e.strerror or e}") from None
    if why:
        raise _refuse(path, why)
    if resume and not os.path.isfile(os.path.join(path, RUN)):
        raise UsageError(f"--resume: {path!r} holds no run ({RUN}); start one without --resume")
    if not resume and os.path.isdir(path):
        stray = sorted(set(os.listdir(path)) - {RUN, *CACHED})
        if stray and RUN not in os.listdir(path):
            raise UsageError(f"--work {path!r} holds files that are not a train_assistant run ({', '.join(stray[:3])}"
                             f"{', ...' if len(stray) > 3 else ''}): a new run clears its folder, so name an empty or "
                             "new directory")


def prepare_work(path: str, resume: bool) -> None:
    """The work folder ready for this call: a new run's is created 0700 (exclusively: one that appears
    meanwhile is checked again) or cleared of the previous run's files; a resumed one is kept."""
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made by someone else meanwhile
            pass
    why = _not_own(path)
    if why:
        raise _refuse(path, why)
    if not resume:
        for fn in (RUN, *CACHED, "ckpt.npz.tmp.npz"):
            if os.path.lexists(os.path.join(path, fn)):
                os.remove(os.path.join(path, fn))


# ---- the recorded run (--resume) ------------------------------------------------------------------
def read_run(work: str, args, defaults: dict) -> dict:
    """The run recorded in `work` (run.json), its recipe set on `args` (every flag but THIS_CALL's),
    after checking that it is a run's record for the same --target, and that no flag this call was
    given (a value other than its default, `defaults`) differs from the run's: it would be ignored
    silently. UsageError otherwise."""
    path = os.path.join(work, RUN)
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--resume: {path!r} cannot be read ({one_line(e, 200)}): start the run again without "
                         "--resume") from None
    stored = run.get("args") if isinstance(run, dict) else None
    flags = vars(args)
    if not isinstance(stored, dict) or not set(stored) <= set(flags) or not all(
            v is None or isinstance(v, (bool, int, float, str)) for v in stored.values()):
        raise UsageError(f"--resume: {path!r} is not the record of a train_assistant run: start the run again without "
                         "--resume")
    first = stored.get("target")
    if first is not None and not _same_target(first, args.target):
        raise UsageError(f"--resume: the run in {work!r} trains a drafter for --target {first!r}, not {args.target!r}: "
                         "pass its --target, or another --work for a new run")
    for k, v in stored.items():
        mine = getattr(args, k)
        if k not in THIS_CALL and k != "target" and mine != defaults.get(k) and mine != v:
            flag = "--" + k.replace("_", "-")
            raise UsageError(f"--resume: the run in {work!r} was started with {flag} {v!r}; this call's {flag} "
                             f"{mine!r} cannot change it (a run's recipe is its first call's): drop the flag, or "
                             "start a new run without --resume")
    for k, v in stored.items():
        if k not in THIS_CALL:
            setattr(args, k, v)
    return run


def _same_target(a, b) -> bool:
    if a == b:
        return True
    try:
        return isinstance(a, str) and os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def check_cached(work: str, seq: int) -> None:
    """The arrays a resumed run loads back from `work`, opened and their keys read (rows of `seq`
    tokens): a damaged file is a UsageError naming it, before the target loads."""
    expect = {"data.npz": ("rows", "eval_prompts"), "ordering.npz": ("ordering", "centroids"), "ckpt.npz": ("meta",)}
    for fn, keys in expect.items():
        path = os.path.join(work, fn)
        if not os.path.lexists(path):
            continue
        try:
            with np.load(path, allow_pickle=False) as z:
                got = {k: z[k] for k in keys}
            if fn == "data.npz":
                rows = got["rows"]
                json.loads(str(got["eval_prompts"]))
                if rows.ndim != 2 or rows.shape[1] != seq or not np.issubdtype(rows.dtype, np.integer):
                    raise ValueError(f"its rows are {rows.dtype} {rows.shape}, not this run's rows of {seq} tokens")
            if fn == "ckpt.npz":
                meta = json.loads(str(got["meta"]))
                if not (isinstance(meta, dict) and {"step", "total", "history", "evals"} <= set(meta)):
                    raise ValueError("its meta record is incomplete")
        except Exception as e:  # numpy's and zipfile's errors for a cut or foreign file: all of them mean damaged
            raise damaged(path, e) from None


def damaged(path: str, e: BaseException) -> UsageError:
    return UsageError(f"--resume: {path!r} is damaged ({one_line(e, 200)}): delete it (the run computes it "
                      "again) or start again without --resume")
