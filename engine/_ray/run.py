"""The driver of a Ray backfill: plan, skip what is committed, map the rest over an actor pool, mark completion.

Why each block is scored exactly once, whatever stops the job: docs/design.md, Backfills on Ray.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine import _json
from engine._backfill.checkpoint import hold_lock
from engine._backfill.parquet import verifier_identity
from engine._backfill.rewards import Rewards
from engine._backfill.run import check_provenances
from engine._check import check_ready
from engine._columns import Columns
from engine._config import EngineConfig
from engine._core.report import VerifierTotals
from engine._core.threads import in_thread
from engine._engine import Engine
from engine._errors import ConfigError, EngineError, OutputError, ResumeError
from engine._ray.actor import BlockScorer, Carried, absolute, blocks_to_do, split_limits
from engine._ray.plan import (
    DEFAULT_BLOCK_ROWS,
    Block,
    Plan,
    check_outdir,
    committed,
    load_plan,
    make_plan,
    part_name,
    plan_path,
    resolve_inputs,
    save_json,
    success_path,
    tmp_dir,
    whole_parts,
)

__all__ = [
    "DEFAULT_ACTORS",
    "DEFAULT_ACTOR_CPUS",
    "NO_PROGRESS_TIMEOUT",
    "RaySummary",
    "backfill",
    "check_data_options",
    "engine_error",
    "set_data_options",
]

DEFAULT_ACTORS = 2
DEFAULT_ACTOR_CPUS = 1.0  # one core per actor: a plugin's Python runs under its actor's GIL
# seconds without a block done before Ray Data fails the job (its default: 30 min);
# RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S overrides it, as it does Ray's own default
NO_PROGRESS_TIMEOUT = 600.0
NO_PROGRESS_VARIABLE = "RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S"
SUCCESS_FORMAT = "engine-ray-success/1"

Progress = Callable[[int], None]  # told how many rows are done, after each block


@dataclass
class RaySummary:
    """What :func:`backfill` did: rows in the output, rows committed before this run, this run's verifier totals.

    ``already_complete``: the output was complete before this run, which did nothing. ``seconds``:
    time to start (or join) Ray, and to score the blocks; ``elapsed``: the whole run's. ``rescored``:
    the part files found not whole (cut short, overwritten) and scored again. ``rewards``: the
    distribution of the output's rewards, the parts committed before this run included (empty when
    ``already_complete``: nothing is read then).
    """

    output: Path
    rows: int
    resumed_at: int
    blocks: int
    verifiers: dict[str, VerifierTotals]
    already_complete: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    rescored: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    rewards: Rewards = field(default_factory=Rewards)


def no_progress_timeout() -> float:
    """:data:`NO_PROGRESS_TIMEOUT`, or the seconds ``RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S`` says."""
    value = os.environ.get(NO_PROGRESS_VARIABLE)
    try:
        return float(value) if value else NO_PROGRESS_TIMEOUT
    except ValueError:
        raise ConfigError(f"{NO_PROGRESS_VARIABLE} must be a number of seconds, got {value!r}") from None


def set_data_options(context: Any, timeout: float | None = None) -> None:
    """Set the Ray Data options a backfill relies on in ``context``, a dataset's own ``DataContext``.

    Ray copies the driver's context into each dataset it makes, so this changes nothing else in
    the driver. Never drop a block (``max_errored_blocks = 0``), never retry one that raised, raise
    an actor's exception itself (so the engine's error reaches the driver whole), fail a job that
    makes no progress, or cannot start its actors, for ``timeout`` seconds (default:
    :func:`no_progress_timeout`), and draw no progress bars (the CLI draws its own).
    """
    timeout = no_progress_timeout() if timeout is None else timeout
    context.max_errored_blocks = 0
    context.actor_task_retry_on_errors = False
    context.raise_original_map_exception = True
    context.execution_no_progress_timeout_s = timeout
    context.wait_for_min_actors_s = max(1, math.ceil(timeout))
    context.enable_progress_bars = False


def check_data_options(context: Any) -> None:
    """Refuse a dataset's Ray Data options under which rows would be dropped or verification errors retried
    (``ValueError``); make an actor's exception reach the consumer itself, not as its text."""
    if context.max_errored_blocks != 0:
        raise ValueError(
            f"DataContext.max_errored_blocks is {context.max_errored_blocks}: Ray Data would drop the rows of a "
            "block whose verifier failed, silently; set it to 0"
        )
    if context.actor_task_retry_on_errors is not False:
        raise ValueError("DataContext.actor_task_retry_on_errors is set: a verification error must not be retried")
    context.raise_original_map_exception = True


def engine_error(exc: BaseException) -> EngineError | None:
    """The engine's own error an actor raised, out of whatever Ray wrapped it in; None if there is none."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, Carried):
            return current.error
        if isinstance(current, EngineError):
            return current
        for linked in (current.__cause__, current.__context__, getattr(current, "cause", None)):
            if isinstance(linked, BaseException):
                stack.append(linked)
    return None


def _merge(summary: RaySummary, block: dict[str, Any]) -> None:
    """Add a block's figures (``BlockScorer.score_block``'s) to ``summary``."""
    totals = summary.verifiers
    for key, data in block["verifiers"].items():
        add = VerifierTotals.from_json(data)
        totals.setdefault(key, VerifierTotals(add.kind, add.ref)).merge(add)
    summary.rewards.merge(Rewards.from_json(block["rewards"]))


def _committed_rewards(outdir: Path, parts: Collection[str]) -> Rewards:
    """The distribution of the rewards in whole parts committed before this run (their reward column only)."""
    rewards = Rewards()
    for name in sorted(parts):
        try:
            column = pq.read_table(outdir / name, columns=["reward"]).column("reward")
        except (OSError, pa.ArrowException) as exc:
            raise OutputError(f"cannot read the rewards of {outdir / name}: {exc}") from exc
        rewards.add(cast("list[float]", column.to_pylist()))  # a part's reward column is float64, never null
    return rewards


def _distinct_structs(column: pa.Array[Any]) -> list[dict[str, Any]]:
    """The distinct values of a part's verifier column, as dicts: grouped by Arrow on its leaf fields (a struct
    cannot be a key: the judge's parameters are flattened, then put back), less ``cached`` (a time per hit)."""
    paths: list[tuple[int, ...]] = []
    names: list[str] = []

    def leaves(kind: pa.StructType, path: tuple[int, ...], prefix: str) -> None:
        for i in range(kind.num_fields):
            child = kind.field(i)
            if not path and child.name == "cached":
                continue
            if pa.types.is_struct(child.type):
                leaves(child.type, (*path, i), f"{prefix}{child.name}.")
            else:
                paths.append((*path, i))
                names.append(f"{prefix}{child.name}")

    leaves(column.type, (), "")
    table = pa.Table.from_arrays([pc.struct_field(column, list(path)) for path in paths], names=names)
    distinct = []
    for flat in table.group_by(names, use_threads=False).aggregate([]).to_pylist():
        nested: dict[str, Any] = {}
        for name in names:
            *parents, leaf = name.split(".")
            place = nested
            for parent in parents:
                place = place.setdefault(parent, {})
            place[leaf] = flat[name]
        for key, value in nested.items():  # a struct all of whose fields are null was a null (another kind's)
            if isinstance(value, dict) and all(v is None for v in value.values()):
                nested[key] = None
        distinct.append(nested)
    return distinct


def _committed_provenances(outdir: Path, parts: Collection[str]) -> dict[str, list[dict[str, Any]]]:
    """Each environment's distinct verifier provenances in whole parts committed before this run (their verifier
    column only, its distinct values found by Arrow: no row is converted to Python)."""
    recorded: dict[str, list[dict[str, Any]]] = {}
    for name in sorted(parts):
        try:
            column = pq.read_table(outdir / name, columns=["verifier"]).column("verifier").combine_chunks()
            if pa.types.is_struct(column.type):
                distinct = _distinct_structs(column)
            else:  # a part written before the struct: JSON text
                distinct = [_json.loads(text) for text in pc.unique(column).to_pylist() if text is not None]
        except (OSError, pa.ArrowException, ValueError) as exc:
            raise OutputError(f"cannot read the verifiers of {outdir / name}: {exc}") from exc
        for provenance in distinct:
            known = recorded.setdefault(str(provenance.get("environment")), [])
            canonical = verifier_identity(provenance)
            if canonical not in known:
                known.append(canonical)
    return recorded


def _current_provenances(config: EngineConfig, names: Collection[str]) -> dict[str, dict[str, Any]]:
    """The provenance each environment of ``names`` resolves to now: on an engine of the driver's own, each one
    checked (and a plugin imported) as a run checks them; in a thread of its own, so a caller's loop is never used."""

    async def resolve() -> dict[str, dict[str, Any]]:
        async with Engine(config) as engine:
            await check_ready(engine, (config.environments / name for name in names),
                              which="the committed parts name", then=", checked before scoring any block")
            return {name: {**engine._verifier(name).provenance(), "environment": name} for name in names}

    return in_thread(lambda: anyio.run(resolve, backend="asyncio"), "engine-resume-check").result()


def _check_resume(outdir: Path, whole: Collection[str], config: EngineConfig | None) -> None:
    """Refuse a resume whose configuration resolves an environment of the committed parts to another verifier than
    theirs (the output would mix two verifiers' rewards under one name). Through an ``engine serve`` (no config
    here) the service's verifiers are not known to the driver: not checked."""
    if config is None or not whole:
        return
    recorded = _committed_provenances(outdir, whole)
    known = {name for name in recorded if (config.environments / name).is_dir()}
    check_provenances(recorded, _current_provenances(config, sorted(known)),
                      where=f"the parts already committed in {outdir}",
                      instead=f"write to a new output directory (or delete {outdir}) to score every row with the "
                              "verifier now")


def _prepare(outdir: Path, plan: Plan, resume: bool) -> bool:
    """Check ``outdir`` against ``plan``; True if it already holds the complete output (nothing to do)."""
    saved = load_plan(outdir)
    same = saved is not None and saved.to_json() == plan.to_json()
    if success_path(outdir).exists():
        if same:
            return True
        raise OutputError(
            f"{outdir} holds the complete output of another input (or of this input before it changed): "
            "choose another directory, or delete it to score again"
        )
    if saved is None:
        if resume:
            raise ResumeError(f"no interrupted run to resume: {plan_path(outdir)} does not exist; run without --resume")
        if committed(outdir):
            raise OutputError(f"{outdir} holds part files but no plan: choose another directory, or delete it")
        save_json(plan_path(outdir), plan.to_json())
        return False
    if not resume:
        raise ResumeError(
            f"an interrupted run exists for {outdir} ({plan_path(outdir)}): use --resume to continue it, "
            f"or delete {outdir} to start over"
        )
    if not same:
        raise ResumeError(
            f"the input changed since the run started (its files, sizes, times or rows, --json-columns or the column "
            f"mapping differ from {plan_path(outdir)}): resume with that input, or delete {outdir} to start over"
        )
    return False


def backfill(
    input_spec: str | Path,
    outdir: str | Path,
    config: EngineConfig | None,
    *,
    resume: bool = False,
    actors: int = DEFAULT_ACTORS,
    url: str | None = None,
    token: str | None = None,
    address: str | None = None,
    actor_cpus: float = DEFAULT_ACTOR_CPUS,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    no_progress_timeout: float | None = None,
    progress: Progress | None = None,
    json_columns: Collection[str] = (),
    columns: Mapping[str, str] | None = None,
) -> RaySummary:
    """Score every row of ``input_spec`` into Parquet parts in ``outdir`` on Ray; see the module docstring.

    ``json_columns``: the columns of its Parquet files holding JSON text (``--json-columns``,
    :func:`engine._backfill.input.open_rows`). ``columns``: where each field of a row is read from
    (``--columns``: ``{"environment": "data_source", "task.reference": "reward_model.ground_truth"}``),
    replacing the config's ``[input.columns]``; ``ValueError`` for a mapping that is not one.

    ``config`` is split over the ``actors`` (:func:`engine._ray.actor.split_limits`) unless ``url``
    names an ``engine serve`` every actor scores through. Ray is joined if this process already
    runs it, else started or reached at ``address`` (``ray.init``; None: ``RAY_ADDRESS`` or a
    local Ray), and shut down at the end if it was started here.

    Raises ``VerificationError`` (its notes name the input file and line), ``InputError``,
    ``OutputError`` or ``ResumeError``, as ``engine score`` does.
    """
    if actors < 1:
        raise ValueError(f"actors must be >= 1, got {actors}")
    if config is None and url is None:
        raise ValueError("a config is needed unless every actor scores through an engine serve (url)")
    began = time.monotonic()
    outdir = Path(outdir)
    mapping = Columns.chosen(columns, config.input_columns if config is not None else {})
    plan = make_plan(resolve_inputs(input_spec), block_rows, json_columns, mapping)
    check_outdir(outdir)
    try:
        outdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {outdir}: {exc}") from exc
    with hold_lock(outdir / "_run"):
        complete = _prepare(outdir, plan, resume)
        whole, broken = whole_parts(outdir, plan)
        if complete:
            if len(whole) == len(plan.blocks):
                return RaySummary(outdir, plan.rows, plan.rows, len(plan.blocks), {}, already_complete=True,
                                  elapsed=time.monotonic() - began)
            success_path(outdir).unlink()  # a part was cut short, overwritten or removed since: no longer complete
        shutil.rmtree(tmp_dir(outdir), ignore_errors=True)  # parts a stopped run was writing
        for name in broken:  # never left beside the whole ones: the directory is read as one table
            (outdir / name).unlink(missing_ok=True)
        todo = list(blocks_to_do(plan, whole))
        if todo and whole:  # a resume, or a complete output repaired (a part lost): never two verifiers mixed
            _check_resume(outdir, whole, config)
        done = plan.rows - sum(block.rows for _, block in todo)
        summary = RaySummary(outdir, plan.rows, done, len(plan.blocks), {}, rescored=broken,
                             rewards=_committed_rewards(outdir, whole))
        if progress is not None:
            progress(done)
        if todo:
            _score_blocks(todo, outdir, config, summary, actors=actors, url=url, token=token, address=address,
                          actor_cpus=actor_cpus, no_progress_timeout=no_progress_timeout, progress=progress,
                          json_columns=plan.json_columns, columns=mapping)
        missing = [part_name(block) for block in plan.blocks if part_name(block) not in committed(outdir)]
        if missing:  # Ray said every block was done: a part missing now is a bug, never a complete output
            raise RuntimeError(f"{len(missing)} part file(s) missing after every block was scored: {missing[:3]}")
        shutil.rmtree(tmp_dir(outdir), ignore_errors=True)
        save_json(success_path(outdir), {"format": SUCCESS_FORMAT, "rows": plan.rows, "parts": len(plan.blocks)})
        summary.elapsed = time.monotonic() - began
        return summary


def _score_blocks(
    todo: list[tuple[str, Block]],
    outdir: Path,
    config: EngineConfig | None,
    summary: RaySummary,
    *,
    actors: int,
    url: str | None,
    token: str | None,
    address: str | None,
    actor_cpus: float,
    no_progress_timeout: float | None,
    progress: Progress | None,
    json_columns: tuple[str, ...],
    columns: Columns,
) -> None:
    import ray
    import ray.data

    began = time.monotonic()
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    try:
        summary.seconds["ray_start"] = time.monotonic() - began
        items = [{"block": _json.dumps([path, astuple(block)]).decode()} for path, block in todo]
        # no more actors than blocks: a resume with one block left would start an actor that never gets one,
        # and Ray Data warns about it (and each actor's share of the limits would be smaller than it needs)
        actors = min(actors, len(items))
        per_actor = None if config is None else absolute(split_limits(config, actors) if url is None else config)
        blocks = ray.data.from_items(items, override_num_blocks=len(items))
        set_data_options(blocks.context, no_progress_timeout)  # shared by the map below, and by nothing else
        dataset = blocks.map_batches(
            BlockScorer,
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=actor_cpus,
            fn_constructor_kwargs={
                "outdir": str(outdir.resolve()),
                "config": per_actor,
                "url": url,
                "token": token,
                "json_columns": json_columns,
                "columns": columns,
            },
        )
        done = summary.resumed_at
        scoring = time.monotonic()
        try:
            for row in dataset.iter_rows():
                _merge(summary, _json.loads(row["totals"]))
                done += int(row["rows"])
                if progress is not None:
                    progress(done)
        except Exception as exc:
            error = engine_error(exc)
            if error is None:
                raise
            raise error from None
        summary.seconds["scoring"] = time.monotonic() - scoring
    finally:
        if started_here:
            with contextlib.suppress(Exception):
                ray.shutdown()
