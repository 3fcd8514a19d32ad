"""models.save writes only its own files (issue 41, cases 4, 5, 7): files get the umask's mode, the
manifest names what a save wrote and the next save deletes only that, a full disk is an OSError
(ENOSPC) that leaves the previous checkpoint loadable."""
import errno
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from safetensors import SafetensorError
from safetensors.numpy import save_file

from jaxspec import models
from jaxspec.models import checkpoint, checkpoint_files, layer_scan, presets
from jaxspec.kernels import DispatchConfig
from support.seeds import seeded_int, seeded_rng

# dense=False: these tests are about the stored (quantized) format, which a CPU's loaders would
# otherwise dequantize at load (DispatchConfig.dense, models.dense)
XLA = DispatchConfig(backend="xla", dense=False)
CFG = models.TargetConfig.from_dict(presets.tiny_target_dict())
MANIFEST = getattr(checkpoint, "MANIFEST", "jaxspec_manifest.json")
SMALL = 64 << 10  # shard_bytes that make several shards of the tiny model


@pytest.fixture(scope="module")
def two_models():
    return [presets.random_model(CFG, jax.random.PRNGKey(seeded_int(1 << 30)), dtype=jnp.float32, quantize=None,
                                 matmul=XLA) for _ in range(2)]


def assert_loads_as(path, model):
    got = layer_scan.unstack_params(CFG, models.load_target(str(path), dtype=jnp.float32, matmul=XLA).params)
    want = layer_scan.unstack_params(CFG, model.params)
    assert set(got) == set(want)
    for name, w in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(w), err_msg=name)


def foreign_safetensors(path):
    save_file({"model.norm.weight": seeded_rng().standard_normal(64).astype(np.float32)}, str(path))
    return path.read_bytes()


def listing(path):
    return sorted(os.listdir(path))


# ---- case 4: the umask decides the mode ------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_saved_files_have_the_umasks_mode(two_models, tmp_path, umask):
    old = os.umask(umask)
    try:
        models.save(two_models[0], str(tmp_path / "c"), shard_bytes=SMALL)
    finally:
        os.umask(old)
    modes = {f: os.stat(tmp_path / "c" / f).st_mode & 0o777 for f in listing(tmp_path / "c")}
    assert len(modes) > 3 and modes == {f: 0o666 & ~umask for f in modes}
    assert os.stat(tmp_path / "c").st_mode & 0o777 == 0o777 & ~umask


# ---- case 5: foreign files stay ------------------------------------------------------------------
def test_save_deletes_only_what_a_save_wrote(two_models, tmp_path):
    """A checkpoint from before manifests (here: the manifest removed) loses only the files save has
    always written (model.safetensors, model-NNNNN-of-NNNNN.safetensors, the index, config.json); with
    a manifest, only the files it lists. Files and directories named like weights stay, and the
    loader does not read them."""
    m0, m1 = two_models
    path = tmp_path / "c"
    models.save(m0, str(path), shard_bytes=SMALL)
    if os.path.exists(path / MANIFEST):
        os.remove(path / MANIFEST)  # as saved before manifests existed
    notes = foreign_safetensors(path / "model_notes.safetensors")
    os.mkdir(path / "model.safetensors")
    (path / "model.safetensors" / "readme").write_text("mine")
    models.save(m1, str(path), shard_bytes=2 * SMALL)
    assert (path / "model_notes.safetensors").read_bytes() == notes
    assert (path / "model.safetensors" / "readme").read_text() == "mine"
    assert_loads_as(path, m1)
    # a name a save writes, held by a directory: refused before anything is written
    before = listing(path)
    with pytest.raises(ValueError, match=rf"cannot save to '{path}': '{path / 'model.safetensors'}' is a directory"):
        models.save(m0, str(path))
    assert listing(path) == before
    os.rename(path / "model.safetensors", tmp_path / "moved")
    # a shard-like name the manifest does not list is not the save's to delete
    extra = foreign_safetensors(path / "model-00099-of-00099.safetensors")
    models.save(m0, str(path))  # one shard: no index
    assert not os.path.exists(path / "model.safetensors.index.json")
    assert (path / "model-00099-of-00099.safetensors").read_bytes() == extra
    assert (path / "model_notes.safetensors").read_bytes() == notes
    assert_loads_as(path, m0)  # the weight-like files beside it are not read


# ---- case 7: a full disk -------------------------------------------------------------------------
def test_a_full_disk_is_an_oserror_and_keeps_the_old_checkpoint(two_models, tmp_path, monkeypatch):
    m0, m1 = two_models
    path = tmp_path / "c"
    models.save(m0, str(path), shard_bytes=SMALL)
    before = {f: (path / f).read_bytes() for f in listing(path)}
    real, calls, fail_at = safetensors.numpy.save_file, [0], seeded_int(1, 3)

    def disk_fills(tensors, fn, metadata=None):  # as safetensors reports it (seen on a full tmpfs)
        calls[0] += 1
        if calls[0] == fail_at:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real(tensors, fn, metadata=metadata)
    monkeypatch.setattr(safetensors.numpy, "save_file", disk_fills)
    monkeypatch.setattr(checkpoint, "save_file", disk_fills, raising=False)
    with pytest.raises(OSError) as e:
        models.save(m1, str(path), shard_bytes=SMALL)
    assert e.value.errno == errno.ENOSPC and "No space left on device" in str(e.value)
    monkeypatch.undo()
    assert {f: (path / f).read_bytes() for f in listing(path)} == before
    assert listing(tmp_path) == ["c"]
    assert_loads_as(path, m0)


# ---- issue 51: a staging entry that is not the save's own directory ------------------------------
@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_staging_entry_outside_the_checkpoint_is_ignored(two_models, tmp_path, kind):
    """A manifest saying a save was cut short (`staged`) whose `.saving-<token>` is a symlink to another
    directory (or not a directory): the loader does not read from it (a file the manifest lists that
    is only there counts as missing: the directory is refused), and the next save neither moves files
    out of it nor deletes what it would have moved."""
    m0, m1 = two_models
    path, outside = tmp_path / "c", tmp_path / "outside"
    models.save(m0, str(path))
    outside.mkdir()
    foreign_safetensors(outside / "model.safetensors")
    (outside / "config.json").write_text('{"not": "a model"}')
    (outside / "authorized_keys").write_text("ssh-ed25519 AAAA key\n")
    before = {f: (outside / f).read_bytes() for f in listing(outside)}
    token = ".saving-" + "%016x" % seeded_int(1 << 62)
    if kind == "symlink":
        os.symlink(outside, path / token)
    else:
        (path / token).write_text("not a directory")
    m = json.loads((path / MANIFEST).read_text())
    m.update(staged=token, files=m["files"] + ["authorized_keys"], stale=[],
             weights={"model.safetensors": os.path.getsize(path / "model.safetensors")})
    (path / MANIFEST).write_text(json.dumps(m))
    config, weights = checkpoint_files.read_config(str(path), complete=False)  # its own files, none from outside
    assert weights == [str(path / "model.safetensors")] and config["model_type"]
    with pytest.raises(ValueError, match="'authorized_keys' is missing from"):  # listed, and only outside
        checkpoint_files.read_config(str(path))
    models.save(m1, str(path))
    assert {f: (outside / f).read_bytes() for f in listing(outside)} == before
    assert not os.path.exists(path / "authorized_keys")
    assert_loads_as(path, m1)
