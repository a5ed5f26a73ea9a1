"""The event port's trust boundary (issue 27, defects 1, 2 and 4), against a real ``manage.py
ingest`` (and ``manage.py gateway``): anyone who can reach the port can name any pod, but a pod
named there is never a routing target, cannot change how another pod is keyed or scored, and
cannot keep a registered pod out."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.loadgen.fake_fleet import PodBehaviour, Served, pod_app
from tests.security.event_port import MODEL, Stack, prompt
from tests.servers import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(tmp_path, redis_url, request):
    env = getattr(request, "param", {})
    stack = Stack(tmp_path, redis_url, **env)
    yield stack
    stack.close()


def test_a_pod_named_host_port_on_the_event_stream_is_never_routed_to(stack):
    """Defect 1: one message of a new pod named like ``host:port`` made a pod the gateway sent
    users (and their Authorization headers) to. Now it gets no address, and every request goes to
    the registered pods, including those of the prefix the impostor announced."""
    real, impostor = PodBehaviour("real"), PodBehaviour("impostor")
    servers = [Served(pod_app(real)), Served(pod_app(impostor))]
    try:
        stack.register("real-0", servers[0].url.removeprefix("http://"))
        fake_id = servers[1].url.removeprefix("http://")  # 127.0.0.1:<port>: where it listens
        announced = prompt(8, 10_000)
        stack.store(fake_id, announced)
        wait_until(lambda: stack.scores(announced).get(fake_id) == 8, what="the impostor's blocks indexed")
        wait_until(lambda: fake_id in stack.pods(), what="the impostor recorded")
        assert stack.pods()[fake_id] == ("", False)  # recorded: no address, not registered

        gateway = stack.start_gateway()
        prompts = [list(announced)] * 10 + [f"a new prompt {i} " * 40 for i in range(30)]
        with httpx.Client(timeout=30) as client:
            for text in prompts:
                body = {"model": MODEL, "prompt": text, "max_tokens": 1}
                answer = client.post(
                    f"{gateway}/v1/completions", json=body, headers={"authorization": "Bearer x"}
                )
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-kvcache-pod"] == "real-0"
        assert len(real.received) == len(prompts)
        assert impostor.received == []
    finally:
        for server in servers:
            server.stop()


def test_one_pod_s_kv_cache_groups_change_only_its_own_scores(stack):
    """Defect 2: one ``BlockStored`` with ``group_idx: 1`` and a ``kv_cache_spec_kind`` taught the
    whole model a KV-cache group, and every other pod's blocks left every score; fuzzed values
    taught it 33 groups and kinds that do not exist. Now what a pod describes applies to its own
    scores, an out-of-range group or an unknown kind is refused or ignored, and a disagreement is
    counted (``kvcache_kv_cache_group_variants``)."""
    shared = prompt(25, 20_000)
    stack.store("honest-0", shared)
    for group, kind in [(1, "sliding_window"), (2, "full_attentiof"), (31, "mamba")]:
        stack.store(
            "liar-0", shared[:32], group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=32
        )
    for group in (32, 2**63, 2**64 - 1):  # beyond any model's groups: refused in decoding
        stack.store("liar-0", shared[:32], group_idx=group, kv_cache_spec_kind="sliding_window")
    stack.store("liar-1", shared[:32], group_idx=1, kv_cache_spec_kind="mamba")

    def described() -> bool:
        with_groups = stack.shell(
            "from registry.models import Pod; "
            "print(sum(1 for g in Pod.objects.values_list('learned_kv_cache_groups', flat=True) if g))",
        )
        return with_groups.strip() == "2"

    wait_until(described, timeout=20, what="the pods' groups recorded")
    scores = stack.registry_scores(shared)
    assert scores["honest-0"] == 25  # untouched by what the others said of their groups
    assert scores.get("liar-0", 0) == 0  # its own description cuts its own hit (it holds no group 1 blocks)
    learned = stack.shell(
        "from registry.models import ModelConfig, Pod; "
        "print(Pod.objects.get(pod_id='liar-0').learned_kv_cache_groups); "
        "print(ModelConfig.objects.filter(name='Qwen/Qwen3-0.6B').exists())",
    )
    groups_line, config_exists = learned.strip().splitlines()[-2:]
    assert "full_attentiof" not in groups_line and "'mamba'" in groups_line  # unknown kind: not learned
    assert groups_line.count("kind") == 32  # group 31 described: 32 groups, none beyond
    assert config_exists == "False"  # no model config made by events
    variants = stack.shell(
        "from registry.selectors import load_service_config as c; print(c().kv_cache_group_variants())",
    )
    assert f"'{MODEL}': 2" in variants  # the two liars disagree: counted, not applied to anyone else
    assert "field" in stack.ingest_log() or stack.alive()


@pytest.mark.parametrize(
    "stack", [{"KVCACHE_INGEST_MAX_PODS": "50", "KVCACHE_INGEST_POD_IDLE_SECONDS": "3"}], indirect=True
)
def test_a_flood_of_pod_names_never_keeps_a_registered_pod_out(stack):
    """Defect 4: after 30,000 made-up pod ids, a new real pod was neither scored nor registered.
    Now registered pods are always admitted; made-up ones take at most KVCACHE_INGEST_MAX_PODS
    places, and one quiet for KVCACHE_INGEST_POD_IDLE_SECONDS gives its place, its row and its
    blocks to a newcomer."""
    stack.register("real-0", "10.0.0.9:8000")
    flood, flooded = [f"flood-{i}" for i in range(300)], prompt(1, 30_000)
    for pod in flood:
        stack.store(pod, flooded)
    real = prompt(4, 40_000)
    stack.store_until_scored("real-0", real)
    admitted = [pod for pod in stack.scores(flooded) if pod.startswith("flood")]
    assert len(admitted) == 50  # the first 50; the other 250 were refused (too_many_pods)

    late = prompt(4, 50_000)
    for pod in flood:  # the flood goes on: every place is held by a pod heard from lately
        stack.store(pod, flooded)
    stack.store("newcomer", late)
    time.sleep(1.0)
    assert "newcomer" not in stack.scores(late)

    time.sleep(3.5)  # the flood's pods are quiet for longer than KVCACHE_INGEST_POD_IDLE_SECONDS
    stack.store("newcomer", late)
    wait_until(lambda: stack.scores(late).get("newcomer") == 4, what="the newcomer admitted")
    wait_until(
        lambda: len(set(admitted) & set(stack.scores(flooded))) == 49, what="the evicted pod's blocks cleared"
    )
    [evicted] = set(admitted) - set(stack.scores(flooded))
    wait_until(lambda: evicted not in stack.pods(), what="the evicted pod's row deleted")
    assert stack.pods()["real-0"] == ("10.0.0.9:8000", True)


@pytest.mark.parametrize("stack", [{"KVCACHE_INGEST_REGISTERED_PODS_ONLY": "true"}], indirect=True)
def test_with_registered_pods_only_the_registry_is_the_allow_list(stack):
    """KVCACHE_INGEST_REGISTERED_PODS_ONLY: only a pod registered for the topic's model is heard."""
    stack.register("real-0", "10.0.0.9:8000")
    tokens = prompt(4, 60_000)
    stack.store("stranger", tokens)
    stack.store("real-0", tokens, model="another/model")  # registered, but for another model
    stack.store_until_scored("real-0", tokens)
    time.sleep(0.5)
    assert set(stack.scores(tokens)) == {"real-0"}
    assert "stranger" not in stack.pods()
