"""The job file: one TOML that every process of a fleet reads.

Each top-level table is one subsystem's frozen config dataclass, owned by
that subsystem::

    [data]        metaps.job.DataConfig           where the Meta-IO datasets are
    [ps]          ps.config.PsConfig              shards, tables, optimizers
    [model]       models.config.ModelConfig       which CTR/CVR model
    [meta]        models.meta.MetaConfig          G-Meta inner/outer loop
    [train]       workers.config.TrainConfig      workers, mode, dense sync
    [controller]  controller.config.ControllerConfig   DDS, monitor, policy
    [faults]      common.faults.FaultConfig       injected stragglers/kills
    [rpc]         common.rpc.RpcConfig            token, TLS, message limits
    [delivery]    delivery.config.DeliveryConfig  bundles and publishing
    [run]         metaps.job.RunConfig            run directory
    [deploy]      metaps.deploy.config.DeployConfig   Kubernetes manifests (metaps deploy k8s)
    [log]         common.log.LogConfig            log line format (text or JSON)

Example::

    job = load_job("configs/local.toml")
    job.ps.shards, job.train.mode, job.schema().tables
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.config import ControllerConfig
from delivery.config import DeliveryConfig
from common.config import from_mapping, read_toml, to_dict
from common.errors import ConfigError
from common.faults import FaultConfig
from common.log import LogConfig
from common.rpc import RpcConfig
from common.security import redact
from metaps.deploy.config import DeployConfig
from models.config import ModelConfig
from models.meta_config import MetaConfig
from ps.config import PsConfig, TableConfig
from workers.config import TrainConfig

if TYPE_CHECKING:
    from meta_io.schema import Schema


@dataclass(frozen=True)
class DataConfig:
    """Where training and evaluation data live.

    Args:
        train: a Meta-IO dataset directory (meta or plain layout).
        eval: a held-out Meta-IO dataset (users unseen in training); '' for none.
        schema: schema file; '' means the one embedded in the train manifest.
        validation: a Meta-IO dataset ``train-local`` validates on after every epoch (early
            stopping, the best epoch kept) instead of ``[train] val_fraction`` batches of ``train``:
            e.g. built from the later rows of a time split (``metaps meta-io split-holdout --by
            time``), so early stopping sees the drift a random pick of batches hides. Same layout
            as ``train``; '' for none. Not with ``[train] val_fraction``.
    """

    train: str = ""
    eval: str = ""
    schema: str = ""
    validation: str = ""

    def validate(self) -> None:
        if not self.train:
            raise ValueError("data.train (a Meta-IO dataset directory) is required")


@dataclass(frozen=True)
class RunConfig:
    """Where a run leaves its report, checkpoints, logs and plots.

    Args:
        dir: the folder of run directories (``launch`` / ``train-local`` create ``<name>-<time>``
            in it unless given one).
        name: the run's name (its directory's prefix and ``metaps_run`` metrics label).
        plots: draw ``RUN/plots/*.png`` when the run ends (matplotlib: about 4 CPU-s, as long as a
            short run's training); false leaves ``report.json`` and TensorBoard only, and
            ``metaps run-report --run-dir RUN`` draws them later.
    """

    dir: str = "runs/default"
    name: str = "metaps"
    plots: bool = True


def _section_types() -> dict[str, type]:
    # Every section's config is torch-free (tests/metaps/test_job.py checks it), so parsing a
    # job file stays cheap for the controller, agents and `metaps --help`.
    return {
        "data": DataConfig,
        "ps": PsConfig,
        "model": ModelConfig,
        "meta": MetaConfig,
        "train": TrainConfig,
        "controller": ControllerConfig,
        "faults": FaultConfig,
        "rpc": RpcConfig,
        "delivery": DeliveryConfig,
        "run": RunConfig,
        "deploy": DeployConfig,
        "log": LogConfig,
    }


@dataclass(frozen=True)
class JobConfig:
    """Every section of a job file, parsed and validated."""

    data: DataConfig
    ps: PsConfig
    model: ModelConfig
    meta: MetaConfig
    train: TrainConfig
    controller: ControllerConfig
    faults: FaultConfig
    rpc: RpcConfig
    delivery: DeliveryConfig
    run: RunConfig
    deploy: DeployConfig
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    source: str = ""
    """The file this job was read from ('' when built in code)."""

    def schema(self) -> "Schema":
        """The schema: the explicit file, else the one in the train manifest."""
        from meta_io.schema import load_schema, schema_from_dict

        if self.data.schema:
            return load_schema(self.data.schema)
        manifest = Path(self.data.train) / "manifest.json"
        if not manifest.exists():
            raise ConfigError(
                f"{self.source or '<job>'}: data.schema is empty and {manifest} does not exist: "
                + build_hint(self.data.train, self.source)
            )
        return schema_from_dict(json.loads(manifest.read_text())["schema"], where=str(manifest))

    def table_configs(self) -> list[TableConfig]:
        """PS table configs for the schema's tables, dims taken from [model]."""
        schema = self.schema()
        dims = self.model.embedding_dims(schema.tables)
        tables = self.ps.table_configs(schema.tables)
        out = []
        for t in tables:
            if t.dim != dims[t.name]:
                t = dataclasses.replace(t, dim=dims[t.name])
            out.append(t)
        return out

    def with_overrides(self, **sections: Any) -> "JobConfig":
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain data, secrets redacted (``[rpc] token`` -> ``<redacted>``).

        This is what reports and checkpoint manifests store: never the token itself.
        """
        return redact({name: to_dict(getattr(self, name)) for name in _section_types()})


def build_hint(dataset: str, source: str = "") -> str:
    """What to run first when a job's Meta-IO dataset is missing (one clause, no newline).

    Args:
        dataset: the missing dataset directory (``data.train`` or ``data.eval``).
        source: the job file (its header comment may hold the data steps).
    """
    hint = (f"build it first: `metaps meta-io build --input LOGS --schema SCHEMA.json --out {dataset}` "
            f"(logs from `metaps gen-data --out DIR` or your own Parquet/CSV)")
    src = Path(source.split(" --set ")[0]) if source else None
    try:
        if src is not None and src.is_file() and "meta-io build" in src.read_text():
            hint += f"; the data steps are in the comment at the top of {src}"
    except OSError:
        pass
    return hint


def absolute_class_dir(data: dict[str, Any], source: str | Path) -> dict[str, Any]:
    """``data`` with a custom model's ``[model] class_dir`` made absolute against the job file's folder.

    ``class_dir = ""`` becomes the job file's folder, a relative one that folder joined with it. A
    copy of the job (the run directory's ``job.toml``, a Kubernetes ConfigMap) then names the folder
    the user meant, wherever it is read. Other models, and a ``class_dir`` that is already absolute
    or not a string (the loader names it), are left as they are.

    Args:
        data: a parsed job mapping (not modified; a changed copy is returned).
        source: the job file it was read from.
    """
    model = data.get("model")
    if not isinstance(model, dict) or model.get("kind") != "custom":
        return data
    d = model.get("class_dir", "")
    if not isinstance(d, str) or (d and Path(d).is_absolute()):
        return data
    folder = Path(source).resolve().parent
    return {**data, "model": {**model, "class_dir": str((folder / d).resolve() if d else folder)}}


def job_from_mapping(data: dict[str, Any], where: str = "<job>") -> JobConfig:
    """Build a JobConfig from a parsed TOML mapping; missing sections take defaults.

    When ``where`` names a job file (``describe``'s ``FILE --set ...`` included), a custom model's
    ``[model] class_dir`` is made absolute against its folder (:func:`absolute_class_dir`).
    """
    source = Path(where.split(" --set ")[0])
    if source.is_file():
        data = absolute_class_dir(data, source)
    types = _section_types()
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; known: {sorted(types)}")
    sections: dict[str, Any] = {}
    for name, cls in types.items():
        sub = data.get(name, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"{where}: '{name}' must be a table, got {type(sub).__name__}")
        sections[name] = from_mapping(cls, sub, where=where, prefix=name)
    if sections["data"].validation and sections["train"].val_fraction > 0:
        raise ConfigError(f"{where}: data.validation and train.val_fraction both choose the validation batches; "
                          f"set one (got validation = {sections['data'].validation!r}, "
                          f"val_fraction = {sections['train'].val_fraction})")
    return JobConfig(**sections, source=where)


def load_job(path: str | Path, overrides: dict[str, dict[str, Any]] | None = None) -> JobConfig:
    """Read a job TOML. ``overrides`` merge into sections before validation.

    Relative data paths are resolved against the current directory (the
    launcher runs every process from the same directory).
    """
    data = read_toml(path)
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    return job_from_mapping(data, where=str(path))
