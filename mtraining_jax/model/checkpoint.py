"""Our model checkpoint format, and reading weights back from it or from a training run.

A model checkpoint is ``<dir>/model.yaml`` (the :class:`ModelConfig`) and ``<dir>/params/`` (an
Orbax ``StandardCheckpointer`` directory of ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``,
layers stacked). A training run's checkpoints (``<run_dir>/checkpoints/<step>/state``, the pytree
``{step, params, opt_state, rng}``, ``model.yaml`` beside the step folders) are read the same way:
:func:`find_model_checkpoint` accepts a converter output, a ``run_dir``, its ``checkpoints`` folder
or one ``checkpoints/<step>``; :func:`read_params` restores only ``params``. Shapes are checked
against the stored metadata first: :class:`ParamShapeError` names every mismatch with both shapes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.hf_io import model_from_params, model_params
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM, abstract_model

CONFIG_NAME = "model.yaml"
_HOST = socket.gethostname().replace("-", "_") or "localhost"
# .<dst name>.tmp-<host>-<pid> (and .old-): staged_dir's folders; without a host: older versions
_STAGED = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?:(?P<host>[^-/]+)-)?(?P<pid>[0-9]+)")
PARAMS_NAME = "params"
STATE_NAME = "state"  # the array item of a training checkpoint step (train/checkpoint.py)


class ParamShapeError(ValueError):
    """Stored arrays do not match the expected ones: every mismatch named with both shapes."""


@dataclasses.dataclass(frozen=True)
class ModelCheckpointRef:
    """Where a model's config and weights live.

    ``params_dir``: an Orbax pytree directory; ``subtree``: the key of the parameters inside it
    (``None``: the whole tree, our converter's format; ``"params"``: a training state);
    ``step``: the training step (``None`` for a converter output).
    """

    config_file: Path
    params_dir: Path
    subtree: str | None
    step: int | None


def _step_dirs(ckpt_dir: Path) -> list[int]:
    """Finalised step folders (Orbax renames ``<step>.orbax-checkpoint-tmp-*`` when complete)."""
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and (p / STATE_NAME).is_dir())


def find_model_checkpoint(path: str | os.PathLike) -> ModelCheckpointRef:
    """Resolve ``path`` (converter output, ``run_dir``, ``run_dir/checkpoints`` or
    ``run_dir/checkpoints/<step>``; the newest step unless one is named). ``FileNotFoundError``
    naming the path and what was looked for."""
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"model checkpoint not found: {path}")
    if not path.is_dir():
        raise FileNotFoundError(f"model checkpoint {path} is a file, not a directory")
    if (path / PARAMS_NAME).is_dir():
        return ModelCheckpointRef(_need_config(path / CONFIG_NAME, path), path / PARAMS_NAME, None, None)
    step_dir = None
    if (path / STATE_NAME).is_dir() and path.name.isdigit():
        step_dir = path
    else:
        ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        steps = _step_dirs(ckpt_dir)
        if not steps:
            raise FileNotFoundError(
                f"no model checkpoint in {path}: expected {CONFIG_NAME} + {PARAMS_NAME}/ (mtraining-convert "
                f"output) or training checkpoints (<run_dir>/checkpoints/<step>/{STATE_NAME})"
            )
        step_dir = ckpt_dir / str(steps[-1])
    cands = [step_dir.parent / CONFIG_NAME, step_dir.parent.parent / CONFIG_NAME]
    cfg = next((c for c in cands if c.is_file()), cands[0])
    return ModelCheckpointRef(_need_config(cfg, step_dir), step_dir / STATE_NAME, PARAMS_NAME, int(step_dir.name))


def _need_config(cfg: Path, where: Path) -> Path:
    if not cfg.is_file():
        raise FileNotFoundError(f"model checkpoint {where} has no {CONFIG_NAME} (looked for {cfg})")
    return cfg


class DamagedCheckpointError(ValueError):
    """A checkpoint folder whose files are missing or unreadable (not a model mismatch)."""


def stored_shapes(params_dir: str | os.PathLike) -> dict:
    """Nested dict of ``(shape, dtype)`` per stored array (from the Orbax metadata, no data read).
    :class:`DamagedCheckpointError` naming the folder when the metadata is missing or unreadable
    (Orbax itself returns ``None`` there, which would read as "every array is missing")."""
    import orbax.checkpoint as ocp
    from etils import epath

    params_dir = os.path.abspath(os.fspath(params_dir))  # Orbax reads no metadata from relative paths
    if not os.path.isdir(params_dir):
        raise DamagedCheckpointError(f"checkpoint folder {params_dir} does not exist")
    if not os.path.isfile(os.path.join(params_dir, "_METADATA")):
        raise DamagedCheckpointError(f"checkpoint {params_dir} is damaged: its _METADATA file is missing")
    try:
        # the handler's metadata (not PyTreeCheckpointer's): no absl warning about the step-level
        # _CHECKPOINT_METADATA, which lives one folder up in a training checkpoint
        meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(params_dir))
    except Exception as e:  # noqa: BLE001  (JSON, TensorStore and OS errors alike)
        raise DamagedCheckpointError(f"checkpoint {params_dir} is damaged: cannot read its _METADATA "
                                     f"({_first_line(e)})") from None
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict):
        raise DamagedCheckpointError(f"checkpoint {params_dir} is damaged: its _METADATA holds no array tree")
    return jax.tree.map(lambda m: (tuple(m.shape), np.dtype(m.dtype)), tree,
                        is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))


def _root(e: BaseException) -> BaseException:
    """The innermost cause of ``e`` (Orbax wraps TensorStore's precise error)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def check_shapes(stored: Any, target: Any, where: str, prefix: str = "") -> None:
    """``ParamShapeError`` naming every array whose stored shape differs from ``target``'s (a
    pytree of arrays / ``ShapeDtypeStruct``), and every array missing on either side."""
    flat_s = {_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(
        stored, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple))[0]}
    flat_t = {_key(p): tuple(v.shape) for p, v in jax.tree_util.tree_flatten_with_path(target)[0]}
    bad = [f"{prefix}{k}: checkpoint {flat_s[k][0]}, model {flat_t[k]}"
           for k in sorted(flat_s.keys() & flat_t.keys()) if tuple(flat_s[k][0]) != flat_t[k]]
    bad += [f"{prefix}{k}: missing from the checkpoint (model {flat_t[k]})"
            for k in sorted(flat_t.keys() - flat_s.keys())]
    bad += [f"{prefix}{k}: in the checkpoint {flat_s[k][0]} but not in the model"
            for k in sorted(flat_s.keys() - flat_t.keys())]
    if bad:
        more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
        raise ParamShapeError(f"checkpoint {where} does not match the model: " + "; ".join(bad[:8]) + more)


def _key(path) -> str:
    """``a/0/mu`` for dict keys, sequence indices and attributes alike (Orbax's metadata tree
    stores tuples and named tuples as lists / dicts)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def read_params(ref: ModelCheckpointRef, target: Any) -> Any:
    """Restore the parameters of ``ref`` into the structure, shapes, dtypes (stored ones are cast)
    and shardings of ``target`` (``ShapeDtypeStruct`` pytree; ``sharding=None``: host NumPy)."""
    import orbax.checkpoint as ocp

    try:
        shapes = stored_shapes(ref.params_dir)
    except DamagedCheckpointError as e:
        raise DamagedCheckpointError(f"{e}{_other_step(ref)}") from None
    stored = shapes[ref.subtree] if ref.subtree is not None else shapes
    check_shapes(stored, target, str(ref.params_dir.parent if ref.subtree else ref.params_dir),
                 prefix=f"{ref.subtree}/" if ref.subtree else "")
    stored_dtypes = jax.tree.map(lambda s: s[1], stored, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2)
    item = jax.tree.map(lambda t, dt: jax.ShapeDtypeStruct(t.shape, dt, sharding=getattr(t, "sharding", None)),
                        target, stored_dtypes)

    def restore_arg(t):
        if getattr(t, "sharding", None) is None:
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype)

    if ref.subtree is not None:
        item = {ref.subtree: item}
    args = ocp.args.PyTreeRestore(item=item, restore_args=jax.tree.map(restore_arg, item),
                                  partial_restore=ref.subtree is not None)
    try:
        out = ocp.PyTreeCheckpointer().restore(os.path.abspath(ref.params_dir), args=args)
    except Exception as e:  # noqa: BLE001  (truncated or missing array files: TensorStore errors)
        raise DamagedCheckpointError(
            f"checkpoint {ref.params_dir} is damaged: {_first_line(_root(e))}{_other_step(ref)}") from None
    out = out[ref.subtree] if ref.subtree is not None else out
    return jax.tree.map(lambda a, t: a.astype(t.dtype) if a.dtype != t.dtype else a, out, target)


def _other_step(ref: ModelCheckpointRef) -> str:
    """``"; name another step, e.g. <dir>/6"`` for a damaged training checkpoint with siblings."""
    if ref.step is None:
        return ""
    ckpt_dir = ref.params_dir.parent.parent
    others = [n for n in _step_dirs(ckpt_dir) if n != ref.step]
    return f"; name another step, e.g. {ckpt_dir / str(others[-1])}" if others else ""


def save_model_checkpoint(model: Qwen2ForCausalLM, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write ``model`` to ``path``: into a temporary folder next to it, renamed at the end, so a
    failure leaves ``path`` untouched. An existing non-empty ``path`` needs ``force``."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    with staged_dir(path, force) as tmp:
        model.config.to_yaml(tmp / CONFIG_NAME)
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp / PARAMS_NAME, model_params(model))
        ckptr.wait_until_finished()
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's) or cannot tell: keep
    return True


_ACTIVE_STAGED: dict = {}  # the staged_dir blocks now open in this process, by temporary folder


def remove_staged() -> list[Path]:
    """Undo the open :class:`staged_dir` blocks (a signal handler about to end the process calls
    it): remove their temporary folders, put a destination moved aside back; return the folders."""
    import time

    out = sorted(_ACTIVE_STAGED)
    for p in out:
        st = _ACTIVE_STAGED.pop(p)
        for _ in range(20):  # Orbax's writer threads may still create files in it for a moment
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                break
            time.sleep(0.05)
        if st.old.exists() and not st.dst.exists():
            st.old.rename(st.dst)
    return out


class staged_dir:
    """``with staged_dir(dst, force) as tmp:`` write into ``tmp`` (a fresh folder next to ``dst``,
    ``.<name>.tmp-<host>-<pid>``); on success ``tmp`` replaces ``dst``, on any error (Ctrl-C and
    SIGTERM included, see ``mtraining-convert``) it is removed and ``dst`` is untouched. Temporary
    folders of killed conversions (this host, process gone) are removed on the next one.
    ``FileExistsError`` up front when ``dst`` is a non-empty folder and not ``force``; a file
    (or a file in the way) is always refused."""

    def __init__(self, dst: str | os.PathLike, force: bool = False):
        self.dst = Path(dst).absolute()
        parent = self.dst.parent
        self.tmp = parent / f".{self.dst.name}.tmp-{_HOST}-{os.getpid()}"
        self.old = parent / f".{self.dst.name}.old-{_HOST}-{os.getpid()}"
        self.clean_stale()
        if self.dst.exists() and not self.dst.is_dir():
            raise FileExistsError(f"destination {self.dst} is a file, not a directory")
        if self.dst.is_dir() and any(self.dst.iterdir()) and not force:
            raise FileExistsError(f"destination {self.dst} exists and is not empty; pass --force to replace it")
        for p in (parent, *parent.parents):
            if p.exists():
                if not p.is_dir():
                    raise FileExistsError(f"cannot create {self.dst}: {p} is a file")
                break

    def clean_stale(self) -> list[Path]:
        """Remove the temporary folders next to ``dst`` left by killed conversions on this host
        (a conversion killed between its two renames left ``dst`` as ``.old-``: put back)."""
        if not self.dst.parent.is_dir():
            return []
        out = []
        for p in sorted(self.dst.parent.iterdir(), key=lambda p: ".old-" not in p.name):  # .old- first
            m = _STAGED.fullmatch(p.name)
            if m is None or m.group("name") != self.dst.name or p in (self.tmp, self.old):
                continue
            host, pid = m.group("host"), int(m.group("pid"))
            if host not in (None, _HOST) or _pid_alive(pid):
                continue
            if ".old-" in p.name and not self.dst.exists():
                p.rename(self.dst)
            else:
                shutil.rmtree(p, ignore_errors=True)
            out.append(p)
        return out

    def __enter__(self) -> Path:
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        _ACTIVE_STAGED[self.tmp] = self
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            _ACTIVE_STAGED.pop(self.tmp, None)
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        old = None
        if self.dst.exists():
            old = self.old
            self.dst.rename(old)
        self.tmp.rename(self.dst)
        _ACTIVE_STAGED.pop(self.tmp, None)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def load_model_params(path: str | os.PathLike, **overrides) -> tuple[ModelCheckpointRef, ModelConfig, Any]:
    """``(ref, config, params)`` of the model checkpoint at ``path`` (converter output or a
    training run's checkpoint, see :func:`find_model_checkpoint`): the nested parameter dict,
    shapes checked against the stored config (:class:`ParamShapeError`) before anything is read.
    ``overrides`` set execution fields of the config (backend, remat, dtypes; a new
    ``param_dtype`` converts the weights)."""
    ref = find_model_checkpoint(path)
    stored = ModelConfig.from_yaml(ref.config_file)
    cfg = stored.replace(**overrides) if overrides else stored
    target = model_params(abstract_model(stored))
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), target)
    params = read_params(ref, target)
    return ref, cfg, jax.tree.map(lambda a: jnp.asarray(a, cfg.param_dtype), params)


def load_model_checkpoint(path: str | os.PathLike, **overrides) -> tuple[ModelConfig, Qwen2ForCausalLM]:
    """:func:`load_model_params` as a model: ``(config, model)``."""
    _, cfg, params = load_model_params(path, **overrides)
    return cfg, model_from_params(cfg, params)
