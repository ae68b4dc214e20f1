"""A Great Expectations checkpoint on the synthesized data, with HTML data docs.

pandera (agentkiln.schemas) guards each table's shape at every read; this checkpoint states what
the synthesized *data set* must satisfy as a whole (unique seeds and fingerprints, every split's
size, expert trajectories only of sft/rl tasks that exist, bounded episode lengths, known episode
variants; recovery episodes' mistake steps are data, not failures) and renders a
browsable report: open `reports/data_docs/index.html`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from agentkiln.config import SynthesizeParams
from agentkiln.envs import FAMILIES
from agentkiln.schemas import VARIANTS


def _expectations(gx, params: SynthesizeParams, tasks: pd.DataFrame) -> dict[str, list]:
    e = gx.expectations
    n_total = sum(s.n_tasks for s in params.splits.values())
    train_ids = sorted(tasks.loc[tasks["split"].isin(["sft", "rl"]), "task_id"])
    return {
        "tasks": [
            e.ExpectTableRowCountToEqual(value=n_total),
            e.ExpectColumnValuesToBeUnique(column="task_id"),
            e.ExpectColumnValuesToBeUnique(column="seed"),
            e.ExpectColumnValuesToBeUnique(column="fingerprint"),  # deduplicated across splits
            e.ExpectColumnDistinctValuesToEqualSet(column="split", value_set=sorted(params.splits)),
            e.ExpectColumnValuesToBeInSet(column="family", value_set=sorted(FAMILIES)),
            e.ExpectColumnValuesToBeInSet(column="task_type", value_set=sorted(params.task_types)),
            e.ExpectColumnValuesToBeBetween(column="expert_steps", min_value=1, max_value=params.max_expert_steps),
            e.ExpectColumnValuesToNotBeNull(column="env_version"),
        ],
        "expert_trajectories": [
            e.ExpectColumnValuesToBeInSet(column="split", value_set=["sft", "rl"]),  # panels never train
            e.ExpectColumnValuesToBeInSet(column="task_id", value_set=train_ids),
            e.ExpectColumnValuesToBeInSet(column="variant", value_set=list(VARIANTS)),
            e.ExpectColumnValuesToBeInSet(column="mistake", value_set=[False, True]),  # data, not a refusal
            e.ExpectColumnValuesToBeBetween(column="step", min_value=0, max_value=params.max_expert_steps - 1),
            e.ExpectColumnValuesToBeBetween(column="reward", min_value=0.0, max_value=1.0),
            e.ExpectColumnValueLengthsToBeBetween(column="action", min_value=1),
            e.ExpectColumnValuesToNotBeNull(column="observation"),
        ],
    }


def run_checkpoint(params: SynthesizeParams, tasks_dir: Path, docs_dir: Path) -> dict:
    """Validate tasks.parquet and expert_trajectories.parquet, write data docs to `docs_dir`;
    return {"success", "evaluated", "failed": [...]}. Raises ValueError (after writing the docs)
    naming each failed expectation."""
    import great_expectations as gx

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    tasks_dir, docs_dir = Path(tasks_dir), Path(docs_dir)
    frames = {name: pd.read_parquet(tasks_dir / f"{name}.parquet") for name in ("tasks", "expert_trajectories")}
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = gx.data_context.types.base.ProgressBarsConfig(globally=False)
    ctx.add_data_docs_site(site_name="agentkiln", site_config={
        "class_name": "SiteBuilder",
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir.resolve())},
    })
    source = ctx.data_sources.add_pandas("synthesized")
    definitions, batches = [], {}
    for name, expectations in _expectations(gx, params, frames["tasks"]).items():
        batch = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
        suite = ctx.suites.add(gx.ExpectationSuite(name=name))
        for exp in expectations:
            suite.add_expectation(exp)
        definitions.append(ctx.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite)))
        batches[name] = batch
    failed, evaluated = [], 0
    for vd in definitions:  # one table per run: each validation gets its own dataframe
        checkpoint = ctx.checkpoints.add(gx.Checkpoint(
            name=f"synthesized-{vd.name}", validation_definitions=[vd],
            actions=[gx.checkpoint.UpdateDataDocsAction(name="docs", site_names=["agentkiln"])]))
        result = checkpoint.run(batch_parameters={"dataframe": frames[vd.name]})
        for run in result.run_results.values():
            for r in run.results:
                evaluated += 1
                if not r.success:
                    cfg = r.expectation_config
                    failed.append(f"{vd.name}.parquet: {cfg.type} {cfg.kwargs.get('column', '')} "
                                  f"(unexpected: {r.result.get('unexpected_count', r.result.get('observed_value'))})")
    if failed:
        raise ValueError(f"{tasks_dir}: data checkpoint failed ({len(failed)} of {evaluated}); see "
                         f"{docs_dir}/index.html:\n" + "\n".join(f"  - {f}" for f in failed))
    return {"success": True, "evaluated": evaluated, "failed": []}
