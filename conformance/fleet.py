"""Three vLLM pods of one model publishing into our running ingest, and the comparison the suite is
about: per request and pod, the leading blocks vLLM's own cache holds against our score."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm.distributed.kv_events import EventPublisher

from conformance.engines import Engine, event_publisher
from conformance.ours import OurStack
from conformance.spec import Prompt, ServedModel


class Deployment:
    """Our stack, and every pod's vLLM event publisher, connected to its ingest and registered in
    its registry with the publisher's replay endpoint. The publishers are up before ingest starts."""

    def __init__(self, ours: OurStack, models: Iterable[ServedModel]) -> None:
        self.ours = ours
        self.publishers: dict[str, EventPublisher] = {
            pod: event_publisher(
                pod=pod,
                model=model,
                endpoint=ours.ingest_endpoint,
                replay_endpoint=ours.replay_endpoints[pod],
            )
            for model in models
            for pod in model.pods
        }

    def start(self) -> None:
        self.ours.start()

    def stop(self) -> None:
        self.ours.stop()
        for publisher in self.publishers.values():
            publisher.shutdown()


@dataclass(frozen=True)
class Comparison:
    """One request on one pod: vLLM's cached leading blocks and ours (``error``: our API refused)."""

    step: str
    request: str
    pod: str
    vllm_blocks: int
    our_blocks: int
    error: str | None = None

    @property
    def equal(self) -> bool:
        return self.error is None and self.vllm_blocks == self.our_blocks

    def __str__(self) -> str:
        ours = f"our API answered {self.error}" if self.error else f"we score {self.our_blocks}"
        return f"{self.step}: {self.request!r} on {self.pod}: vLLM holds {self.vllm_blocks} blocks, {ours}"


class Fleet:
    """The pods of ``model``, each an ``Engine`` with ``num_blocks`` blocks publishing through its
    pod's publisher, known to ingest (their first batches arrived) before anything is served."""

    def __init__(self, deployment: Deployment, model: ServedModel, *, num_blocks: int) -> None:
        self.stack = stack = deployment.ours
        self.model = model
        self.comparisons: list[Comparison] = []
        self._applied_before = stack.applied_batches()
        self.engines = [
            Engine(pod=pod, model=model, publisher=deployment.publishers[pod], num_blocks=num_blocks)
            for pod in model.pods
        ]
        for engine in self.engines:
            engine.warm_up(lambda pod=engine.pod: stack.has_stream(pod))

    def __getitem__(self, index: int) -> Engine:
        return self.engines[index]

    def sync(self) -> None:
        """Until ingest has applied every batch the pods published."""
        self.stack.wait_applied(self._applied_before + sum(engine.batches for engine in self.engines))

    def serve(
        self, index: int, prompt: Prompt, *, generated: Sequence[int] = (), report_mode: str = "incremental"
    ) -> None:
        """Pod ``index`` serves ``prompt`` (see ``Engine.serve``); then ingest catches up."""
        self.engines[index].serve(prompt, generated=generated, report_mode=report_mode)
        self.sync()

    def check(self, step: str, prompts: Sequence[Prompt]) -> None:
        """Record, for each prompt and pod, vLLM's cached blocks beside our score."""
        pods = self.model.pods
        for prompt in prompts:
            answer = self.stack.score(prompt.score_request(self.model.name, pods))
            for engine in self.engines:
                self.comparisons.append(
                    Comparison(
                        step=step,
                        request=prompt.label,
                        pod=engine.pod,
                        vllm_blocks=engine.cached_blocks(prompt),
                        our_blocks=answer.blocks.get(engine.pod, 0),
                        error=answer.error,
                    )
                )

    def differences(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.equal]

    def report(self) -> str:
        """What differs, one line per (request, pod), with the context a reader needs."""
        differing = self.differences()
        lines = [
            f"{self.model.name} (hash seed {self.engines[0].hash_seed!r}): {len(differing)} of "
            f"{len(self.comparisons)} (request, pod) checks differ from vLLM's own cache:",
            *(f"  {c}" for c in differing),
        ]
        if ignored := self.stack.settings_ignored.get(self.model.name):
            lines.append(f"  (our registry did not keep the model's {', '.join(ignored)}: not supported yet)")
        return "\n".join(lines)
