"""A save killed (SIGKILL) at a random point leaves the old or the new checkpoint (issue 41, case 6).

50 saves, each killed after a random delay (logged) or not at all, with every rename and delete
made slow so the kills land all through the switch. After each, the directory must load, through
the loader's own file resolution (checkpoint_files.read_config), as the previous version or the
new one, bit for bit, and the foreign files beside it must be intact; the saves that follow start
from whatever the kill left. One final save must leave no trace of the killed ones.

Cheap by design: one helper process imports numpy, safetensors and models/checkpoint_files.py
(not the models package: no JAX) once, and forks a child per save; the tensors are small."""
from support.paths import REPO  # noqa: E402
import json
import os
import subprocess
import sys
import time

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxspec.models import checkpoint_files
from support.seeds import seeded_rng

RUNS = 50
SLOW_S = 0.01  # each rename / delete of a killed save's child, so the kills land between them
MODELS = os.path.join(REPO, "models")

# The helper: reads "DIR NPZ N_SHARDS DELAY" lines; forks a child that saves NPZ's tensors as
# N_SHARDS shards (config {"version": the npz name}) with slow renames and deletes; kills it after
# DELAY seconds unless it finished; answers "killed" or "exit CODE".
HELPER = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import checkpoint_files

def slow(f, s=float(sys.argv[2])):
    def g(*a, **k):
        time.sleep(s)
        return f(*a, **k)
    return g

for line in sys.stdin:
    path, npz, n, delay = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            os.replace, os.remove = slow(os.replace), slow(os.remove)
            t = dict(np.load(npz))
            keys = sorted(t)
            shards = [[(k, t[k]) for k in keys[i::int(n)]] for i in range(int(n))]
            checkpoint_files.save_files(path, shards, {"version": os.path.basename(npz)})
            os._exit(0)
        except BaseException as e:
            print(repr(e), file=sys.stderr, flush=True)
            os._exit(1)
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 >= float(delay):
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.0005)
    print("killed" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}", flush=True)
"""


def read_back(path):
    """(version, {name: array}) as the loader finds the checkpoint's files."""
    cfg, weights = checkpoint_files.read_config(str(path))
    tensors = {}
    for fn in weights:
        with safe_open(fn, framework="numpy") as f:
            for k in f.keys():
                assert k not in tensors, f"{k} in two shards"
                tensors[k] = f.get_tensor(k)
    return cfg["version"], tensors


def test_a_killed_save_leaves_the_old_or_the_new_checkpoint(tmp_path):
    rng = seeded_rng()
    path, vdir = tmp_path / "ckpt", tmp_path / "versions"
    vdir.mkdir()
    versions = {}

    def version(i):
        names = [f"model.layers.{j}.w" for j in range(int(rng.integers(3, 7)))]
        t = {k: rng.standard_normal(int(rng.integers(8, 200))).astype(np.float32) for k in names}
        np.savez(vdir / f"v{i}.npz", **t)
        versions[f"v{i}.npz"] = t
        return str(vdir / f"v{i}.npz")

    helper = subprocess.Popen([sys.executable, "-c", HELPER, MODELS, str(SLOW_S)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def save(npz, n, delay):
        helper.stdin.write(f"{path} {npz} {n} {delay}\n")
        helper.stdin.flush()
        return helper.stdout.readline().strip()

    try:
        assert save(version(0), 3, 60) == "exit 0"  # (the helper starting up)
        t0 = time.monotonic()
        assert save(version(0), 3, 60) == "exit 0"
        duration = time.monotonic() - t0  # a save of 3 shards, not killed: the delays span it
        foreign = {"tokenizer.json": b'{"mine": 1}', "model_notes.safetensors": None}
        (path / "tokenizer.json").write_bytes(foreign["tokenizer.json"])
        save_file({"x": rng.standard_normal(4).astype(np.float32)}, str(path / "model_notes.safetensors"))
        foreign["model_notes.safetensors"] = (path / "model_notes.safetensors").read_bytes()
        os.mkdir(path / "model-00007-of-00009.safetensors")
        (path / "model-00007-of-00009.safetensors" / "mine").write_bytes(b"kept")
        current, log = "v0.npz", []
        for i in range(1, RUNS + 1):
            # up to 2x the calibrated save: under CI load a save can run well past the calibration
            n, delay = int(rng.integers(1, 4)), float(rng.uniform(0, 2.0 * duration))
            status = save(version(i), n, round(delay, 4))
            got, tensors = read_back(path)
            log.append(f"run {i}: {n} shard(s), kill at {delay:.4f}s: {status}, loads as {got}")
            assert status in ("killed", "exit 0"), log
            assert got in (current, f"v{i}.npz") and (status == "killed" or got == f"v{i}.npz"), log
            want = versions[got]
            assert sorted(tensors) == sorted(want), log
            for k in want:
                np.testing.assert_array_equal(tensors[k], want[k], err_msg="\n".join(log))
            for f, data in foreign.items():
                assert (path / f).read_bytes() == data, log
            assert (path / "model-00007-of-00009.safetensors" / "mine").read_bytes() == b"kept", log
            current = got
        assert save(version(RUNS + 1), 1, 60) == "exit 0"
        assert read_back(path)[0] == f"v{RUNS + 1}.npz"
        assert sorted(os.listdir(path)) == sorted(["config.json", checkpoint_files.MANIFEST, "model.safetensors",
                                                   "model-00007-of-00009.safetensors", *foreign]), log
        killed = sum("killed" in line for line in log)
        print(f"kill test: {killed} of {RUNS} saves killed; calibrated save {duration:.3f}s\n" + "\n".join(log))
        # The kills landed on both sides of the switch (the count of kills alone depends on the machine's
        # load: a save slowed past every delay is killed each time, yet still after its switch at times).
        old = sum("killed" in line and not line.endswith(f"loads as v{i}.npz") for i, line in enumerate(log, 1))
        new = sum(line.endswith(f"loads as v{i}.npz") for i, line in enumerate(log, 1))
        assert old > 0 and new > 0, log
    finally:
        helper.stdin.close()
        helper.wait(timeout=30)


# ---- issue 51: tiny-pair --force, killed anywhere, leaves the old pair or the new one -------------
# The helper: reads "DIR VERSION K" lines; forks a child that writes a pair the way `tiny-pair` does
# (models/pair_files.save_pair; target and assistant through save_files, then tokenizer.json in
# pieces) and kills itself (SIGKILL) at its K-th step: a file operation (mkdir, rename, replace,
# symlink, remove, fsync) or a tokenizer piece written. K=0: never; then it answers
# "exit 0 STEPS". Every step is a kill point, in turn: no timing involved.
PAIR_HELPER = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import checkpoint_files, pair_files

steps = [0, 0]  # [taken, the one to die at]

def step():
    steps[0] += 1
    if steps[0] == steps[1]:
        os.kill(os.getpid(), signal.SIGKILL)

def counted(f):
    def g(*a, **k):
        step()
        return f(*a, **k)
    return g

def write(folder, version):
    rng = np.random.default_rng(int(version))
    for name in ("target", "assistant"):
        shard = [(f"model.w{j}", rng.standard_normal(64).astype(np.float32)) for j in range(3)]
        checkpoint_files.save_files(os.path.join(folder, name), [shard], {"version": version})
    text = json.dumps({"version": version, "model": {"vocab": {f"t{i}": i for i in range(3000)}}})
    with open(os.path.join(folder, "target", "tokenizer.json"), "w") as f:
        for i in range(0, len(text), 8192):
            step()
            f.write(text[i:i + 8192])
            f.flush()

for line in sys.stdin:
    path, version, k = line.split()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            steps[1] = int(k)
            for name in ("mkdir", "rename", "replace", "symlink", "remove", "fsync"):
                setattr(os, name, counted(getattr(os, name)))
            if sys.argv[2] == "pair":
                pair_files.save_pair(path, lambda folder: write(folder, version))
            else:  # as tiny-pair wrote before issue 51: each model, then the tokenizer, in place
                write(path, version)
            os.write(w, str(steps[0]).encode())
            os._exit(0)
        except BaseException as e:
            print(repr(e), file=sys.stderr, flush=True)
            os._exit(1)
    os.close(w)
    taken = os.read(r, 64).decode()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    print("killed" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)} {taken}".strip(), flush=True)
"""


def read_pair(path):
    """(target's version, assistant's, tokenizer.json's), each read as the loader finds the files;
    the tokenizer must be whole JSON."""
    t = checkpoint_files.read_config(str(path / "target"))[0]["version"]
    a = checkpoint_files.read_config(str(path / "assistant"))[0]["version"]
    tok = json.loads((path / "target" / "tokenizer.json").read_text())["version"]
    return t, a, tok


def test_a_killed_tiny_pair_leaves_the_old_or_the_new_pair(tmp_path, how="pair"):
    """Killed at each of its steps in turn, then run whole: after each, the pair loads as the old
    version or the new one, all three files alike. (how="inplace", the writes tiny-pair did before,
    fails this: a new target and assistant beside an old tokenizer, a truncated tokenizer.json.)"""
    path = tmp_path / "pair"
    # a pair as tiny-pair wrote it before (real directories), and a file of the user's beside it
    for name in ("target", "assistant"):
        checkpoint_files.save_files(str(path / name), [[("model.w0", np.ones(4, np.float32))]], {"version": "0"})
    (path / "target" / "tokenizer.json").write_text('{"version": "0"}')
    (path / "notes.txt").write_text("mine")
    helper = subprocess.Popen([sys.executable, "-c", PAIR_HELPER, MODELS, how], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def save(version, k):
        helper.stdin.write(f"{path} {version} {k}\n")
        helper.stdin.flush()
        return helper.stdout.readline().strip()

    try:
        assert save(1, 0).startswith("exit 0") and read_pair(path) == ("1", "1", "1")
        status = save(2, 0)
        assert status.startswith("exit 0 ") and read_pair(path) == ("2", "2", "2"), status
        steps = int(status.split()[2])
        current, log = "2", []
        for k in range(1, steps + 1):
            status = save(k + 2, k)
            got = read_pair(path)
            log.append(f"killed at step {k} of {steps}: {status}, loads as {got}")
            assert status == "killed" and got in ((current,) * 3, (str(k + 2),) * 3), log
            current = got[0]
        assert (path / "notes.txt").read_text() == "mine"
        assert save(99, 0).startswith("exit 0") and read_pair(path) == ("99", "99", "99")
        pairs = [f for f in os.listdir(path) if f.startswith(".pair-")]
        assert len(pairs) == 2, pairs  # the new pair, and the real directories of before (kept)
        assert current != "2", log  # killed after the switch: the new pair stayed
        print(f"pair kill test: killed at each of {steps} steps\n" + "\n".join(log))
    finally:
        helper.stdin.close()
        helper.wait(timeout=30)


# ---- issue 65: a checkpoint's other files (convert's tokenizer) switch with its weights -----------
# The helper: reads "DIR VERSION K" lines; forks a child that saves a one-shard checkpoint whose
# config and tokenizer.json carry VERSION (the tokenizer written in pieces, as extra_files) and kills
# itself at its K-th step (a file operation or a piece written; K=0: never, then "exit 0 STEPS").
EXTRA_HELPER = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import checkpoint_files

steps = [0, 0]

def step():
    steps[0] += 1
    if steps[0] == steps[1]:
        os.kill(os.getpid(), signal.SIGKILL)

def counted(f):
    def g(*a, **k):
        step()
        return f(*a, **k)
    return g

def tokenizer(folder, version):
    text = json.dumps({"version": version, "model": {"vocab": {f"t{i}": i for i in range(3000)}}})
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        for i in range(0, len(text), 8192):
            step()
            f.write(text[i:i + 8192])
            f.flush()

for line in sys.stdin:
    path, version, k = line.split()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            steps[1] = int(k)
            for name in ("mkdir", "rename", "replace", "remove", "fsync"):
                setattr(os, name, counted(getattr(os, name)))
            shard = [(f"model.w{j}", np.full(16, float(version), np.float32)) for j in range(2)]
            if sys.argv[2] == "switched":
                checkpoint_files.save_files(path, [shard], {"version": version},
                                            extra_files=lambda d: tokenizer(d, version))
            else:  # as convert wrote before issue 65: the checkpoint, then the tokenizer in place
                checkpoint_files.save_files(path, [shard], {"version": version})
                tokenizer(path, version)
            os.write(w, str(steps[0]).encode())
            os._exit(0)
        except BaseException as e:
            print(repr(e), file=sys.stderr, flush=True)
            os._exit(1)
    os.close(w)
    taken = os.read(r, 64).decode()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    print("killed" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)} {taken}".strip(), flush=True)
"""


def read_with_tokenizer(path):
    """(config's version, the weights', tokenizer.json's), each file found as the loaders find it
    (the tokenizer through checkpoint_files.located, as jaxspec.text.tokenizer reads it); None for a
    tokenizer that is missing (the loader refuses that directory)."""
    cfg, weights = checkpoint_files.read_config(str(path))
    with safe_open(weights[0], framework="numpy") as f:
        w = str(int(f.get_tensor("model.w0")[0]))
    tok = checkpoint_files.located(str(path), "tokenizer.json")
    return cfg["version"], w, json.loads(open(tok).read())["version"] if os.path.exists(tok) else None


def test_a_killed_save_switches_its_tokenizer_with_its_weights(tmp_path, how="switched"):
    """A save with extra_files (convert: weights, config and tokenizer) killed at each of its steps in
    turn: after each, the directory reads as the old version or the new one, all three alike.
    (how="inplace", convert's order before, fails this: the new weights beside the old tokenizer.)"""
    path = tmp_path / "converted"
    helper = subprocess.Popen([sys.executable, "-c", EXTRA_HELPER, MODELS, how], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def save(version, k):
        helper.stdin.write(f"{path} {version} {k}\n")
        helper.stdin.flush()
        return helper.stdout.readline().strip()

    try:
        assert save(1, 0).startswith("exit 0") and read_with_tokenizer(path) == ("1", "1", "1")
        status = save(2, 0)  # the steps of a save over a checkpoint (the first one also made the folder)
        assert status.startswith("exit 0 ") and read_with_tokenizer(path) == ("2", "2", "2"), status
        steps = int(status.split()[2])
        current, log = "2", []
        for k in range(1, steps + 1):
            status = save(k + 2, k)
            got = read_with_tokenizer(path)
            log.append(f"killed at step {k} of {steps}: {status}, reads as {got}")
            assert status == "killed" and got in ((current,) * 3, (str(k + 2),) * 3), log
            current = got[0]
        assert current != "2", log  # killed after the switch: the new version stayed
        assert save(99, 0).startswith("exit 0") and read_with_tokenizer(path) == ("99", "99", "99")
        assert sorted(os.listdir(path)) == ["config.json", checkpoint_files.MANIFEST, "model.safetensors",
                                            "tokenizer.json"]
    finally:
        helper.stdin.close()
        helper.wait(timeout=30)
