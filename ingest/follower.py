"""An index of one process's own (``--index in-process``) follows the registry's writes itself.

With a shared index, a registry write clears what it makes wrong there (``registry.services``): a
pod deleted or disabled loses its blocks, a model whose block size changed is emptied, and so is
every model when the hash seed changed (every key depends on them). Writes made by another process
(the admin, the registry API, an ingest expiring a pod) never reach an index that lives in this
process, so ``RegistryFollower`` compares each registry snapshot with the one before and does the
same to it. A pod that left the registry is also forgotten by the pipeline (what its workers
remember of its engines, its place in the receiver, its counters), as an expired pod is.

No Django: the snapshots come from a callable, the index is any ``KVIndex``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvindex import KVIndex
from registry.config import ServiceConfig
from registry.liveness import clear_pod_and_ranks

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RegistryChanges:
    """What changed between two registry snapshots that invalidates index entries."""

    gone_pods: frozenset[str] = frozenset()
    """Pods that left the registry (deleted, expired)."""
    disabled_pods: frozenset[str] = frozenset()
    """Pods disabled since."""
    seed_changed: bool = False
    """The hash seed changed: every model's keys are wrong."""
    resized_models: frozenset[str] = frozenset()
    """Models whose block size changed (a model config added, edited or deleted)."""

    def __bool__(self) -> bool:
        return bool(self.gone_pods or self.disabled_pods or self.seed_changed or self.resized_models)


def registry_changes(before: ServiceConfig, after: ServiceConfig) -> RegistryChanges:
    """The changes from ``before`` to ``after`` that ``registry.services`` clears a shared index for."""
    models = set(before.models) | set(after.models) | before.pod_models | after.pod_models
    return RegistryChanges(
        gone_pods=frozenset(before.pods) - frozenset(after.pods),
        disabled_pods=(after.disabled_pods - before.disabled_pods) & frozenset(after.pods),
        seed_changed=before.seed != after.seed,
        resized_models=frozenset(
            m for m in models if before.model(m).block_size != after.model(m).block_size
        ),
    )


class RegistryFollower:
    """Applies each registry change to ``index`` (``run_once``, from one thread): the pods gone
    or disabled are cleared (and ``forget_pod`` is called with the gone ones), the models whose
    keys changed are emptied. The first snapshot read is the baseline."""

    def __init__(
        self,
        *,
        index: KVIndex,
        config: Callable[[], ServiceConfig],
        forget_pod: Callable[[str], None] = lambda pod: None,
    ) -> None:
        self.index = index
        self.config = config
        self.forget_pod = forget_pod
        self._last: ServiceConfig | None = None

    def run_once(self) -> RegistryChanges:
        """Compare the current snapshot with the last one applied; clear what changed. Raises
        what reading the registry raises; an index that fails part way (``IndexUnavailable``)
        leaves the last snapshot as it was, so the next round clears it all again (clearing is
        idempotent)."""
        current = self.config()
        last, changes = self._last, RegistryChanges()
        if last is not None and current is not last:
            changes = registry_changes(last, current)
            if changes:
                self._apply(changes)
        self._last = current
        return changes

    def _apply(self, changes: RegistryChanges) -> None:
        for pod in sorted(changes.gone_pods):
            self.forget_pod(pod)
            clear_pod_and_ranks(self.index, pod)
            log.info("pod %s left the registry: its blocks are cleared from this process's index", pod)
        for pod in sorted(changes.disabled_pods):
            clear_pod_and_ranks(self.index, pod)
            log.info("pod %s was disabled: its blocks are cleared from this process's index", pod)
        models = set(changes.resized_models)
        if changes.seed_changed:
            models |= {row.model for row in self.index.pod_blocks()}
        for model in sorted(models):
            self.index.clear_model(model=model)
            log.info("the keys of %s changed (seed or block size): its index data is cleared", model)
