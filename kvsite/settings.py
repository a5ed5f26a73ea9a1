"""Settings, all from the environment (the README's configuration table lists them).

| variable | default | meaning |
|---|---|---|
| REDIS_URL | redis://127.0.0.1:6379/0 | the shared index and the channel layer |
| KVCACHE_INDEX_BACKEND | redis | ``redis``, ``redis-cluster://h:p,h:p``, ``memory`` or ``memory://?...`` |
| KVCACHE_IN_PROCESS_INDEX | memory:// | the index of a process run with ``--index in-process`` |
| KVCACHE_INDEX_LAYOUT | fast | a Redis index's layout (one server or a cluster): ``fast`` or ``compact`` |
| KVCACHE_INDEX_TIMEOUT | 1.0 | seconds a Redis index may take to connect or reply (then 503) |
| KVCACHE_NATIVE | 1 | ``0``: the pure-Python key chain and memory maps even where they are compiled |
| KVCACHE_INGEST_INDEX_TIMEOUT | 10.0 | the same for ``ingest``, whose writes may queue behind others |
| DATABASE_URL | sqlite:///var/db.sqlite3 | pod registry, model configs, hash seed |
| SECRET_KEY | generated into var/secret_key | Django's signing key |
| DEBUG | false | Django debug mode |
| ALLOWED_HOSTS | localhost,127.0.0.1,[::1] | comma-separated |
| KVCACHE_HASH_SEED | $PYTHONHASHSEED or "vllm-none-hash" | the engines' PYTHONHASHSEED (initial HashSeed) |
| KVCACHE_BLOCK_SIZE | 16 | tokens per KV block (default for models without a config) |
| KVCACHE_API_KEYS | "" (open) | comma-separated keys; when set, scoring needs ``Bearer <key>`` auth |
| KVCACHE_MAX_BODY_BYTES | 4194304 (4 MiB) | largest scoring request body accepted (larger: 413) |
| KVCACHE_TOKENIZERS_DIR | "" (none) | tokenizer discovery root (HF-cache or ``org/name/`` layout) |
| KVCACHE_ALLOW_HUB | false | download tokenizers from the model hub when no local source has one |
| KVCACHE_PREFIX_STORE_CAPACITY | 500000 | prompt chunks the tokenization prefix store keeps (0 disables it) |
| KVCACHE_INGEST_MAX_MESSAGE_BYTES | 2097152 | a larger KV-event payload is counted (too_large) and skipped |
| KVCACHE_INGEST_MAX_EVENTS | 4096 | a batch with more events is counted (too_many_events) and skipped |
| KVCACHE_INGEST_MAX_BLOCKS | 65536 | an event with more blocks is counted (too_many_blocks) and skipped |
| KVCACHE_INGEST_MAX_PODS | 4096 | unregistered pods one ingest receives from at once (more: too_many_pods) |
| KVCACHE_INGEST_POD_IDLE_SECONDS | 600 | an unregistered pod quiet this long gives its place to a new one |
| KVCACHE_INGEST_REGISTERED_PODS_ONLY | false | take KV events only from pods registered for their model |
| KVCACHE_DYNAMO_BLOCKS | false | ingest records blocks as Dynamo hashes them, for ``/kv-indexer/dump`` |
| KVCACHE_INGEST_CURVE_SECRET_KEY_FILE | "" (off) | ingest's CURVE key pair (``NAME.key_secret``): CURVE on |
| KVCACHE_INGEST_CURVE_CLIENTS_DIR | "" | ``--bind``: the engines' public certificates it admits |
| KVCACHE_INGEST_CURVE_SERVER_KEY_FILE | "" | the engines' public key (``--connect``, replicas, replays) |
| KVCACHE_REPLAY_TIMEOUT_SECONDS | 2.0 | how long ingest waits for an engine's replay of missed batches |
| KVCACHE_REPLAY_PORT_OFFSET | "" (none) | replay endpoint = tcp://host:(port + offset) of the pod's address |
| KVCACHE_GATEWAY_POLICY | kv-load | the gateway's routing policy (routing/policies.py) |
| KVCACHE_GATEWAY_ALPHA | 0.25 | kv-load: the weight of one waiting request against a whole prefix hit |
| KVCACHE_SPECULATIVE_SECONDS | 2.0 | a routed request's blocks count as held by its pod this long |
| KVCACHE_GATEWAY_RETRIES | 2 | next pods tried after a connect error or a 5xx before the first byte |
| KVCACHE_GATEWAY_CONNECT_TIMEOUT | 2.0 | seconds the gateway waits to connect to a pod (then the next pod) |
| KVCACHE_GATEWAY_FIRST_BYTE_TIMEOUT | 300 | seconds the gateway waits for a pod's answer to begin (504) |
| KVCACHE_GATEWAY_POD_API_KEY | "" (the client's) | the ``Bearer`` key the gateway sends the pods |
| KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER | false | send ``x-kvcache-matched-blocks`` (a prefix-cache oracle) |
| KVCACHE_PD_THRESHOLD_TOKENS | 0 | P/D: fewer prompt tokens left to compute skip the prefill step |
| KVCACHE_PD_PREFILL_TIMEOUT | 60 | P/D: seconds for a prefill pod's answer (then served whole) |
| KVCACHE_GATEWAY_URLS | "" (none) | gateways whose routed requests the dashboard counts as scoring traffic |
| KVCACHE_LARGE_PROMPT_CHARS | 262144 | prompts this long are tokenized in a child process (0: never) |
| KVCACHE_SCORING_THREADS | 8 | threads per web worker that run scoring off the event loop |
| KVCACHE_REQUEST_TEMPLATES | true | accept ``chat_template`` in scoring requests (rendered in a sandbox) |
| KVCACHE_TEMPLATE_CPU_MS | 250 | CPU time a request's chat template may use (over it: 422) |
| KVCACHE_TEMPLATE_MAX_OUTPUT_CHARS | 4194304 | longest text a chat template may render (over it: 422) |
| KVCACHE_TEMPLATE_PROCESSES | 1 | sandbox processes per web worker for request templates |
| KVCACHE_HTTP_HEADER_TIMEOUT | 10 | seconds from a request's first byte to its headers' end (then 408) |
| KVCACHE_HTTP_BODY_TIMEOUT | 30 | seconds from a request's headers' end to its body's end (then 408) |
| KVCACHE_HTTP_IDLE_TIMEOUT | 5 | a connection with no request under way is closed after this long |
| KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT | 256 | open connections per client address and worker (0: none) |
| KVCACHE_STATS_GROUP | kvcache-ingest-stats | channel-layer group ingest sends its stats to each second |
| DASHBOARD_PUSH_SECONDS | 1.0 | how often an open dashboard gets fresh numbers over its websocket |
| DASHBOARD_HISTORY_SECONDS | 600 | the span the charts open with (ingest keeps the history in Redis: 24 h) |
| DASHBOARD_STALE_SECONDS | 60 | a pod with no event for this long is no longer active: idle or stale |
| KVCACHE_POD_DOWN_SECONDS | 10 | a pod whose /health fails this long is down: out of scores (0: no probing) |
| KVCACHE_POD_FORGET_SECONDS | 300 | a pod down this long more has its blocks cleared (0: never) |
| KVCACHE_POD_EXPIRE_DAYS | 7 | ingest deletes pods it has not heard from for this long (0: never) |
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("KVCACHE_VAR_DIR", BASE_DIR / "var"))

# Whatever imports transformers (installed as the tests' reference) would print its advice that
# PyTorch is missing, which we never need. Set here, before any import of it: every process that
# loads these settings (each manage.py command, kvsite.asgi, kvsite.wsgi) and its children.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def _secret_key() -> str:
    """SECRET_KEY from the environment, else one generated once into var/ (never committed)."""
    if key := os.environ.get("SECRET_KEY"):
        return key
    path = VAR_DIR / "secret_key"
    if not path.exists():
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env_bool("DEBUG")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")

INSTALLED_APPS = [
    "daphne",  # runserver (development) serves ASGI and websockets through it
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_prometheus",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "registry",  # app label "scoring": the tables and admin URLs of databases made before its move
    "ingest",
    "dashboard",
    "simulator",
    "engines",
    "gateway",
    "epp",
    "kvsite",  # manage.py serve; the API docs' ReDoc page
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # Before CommonMiddleware, the first to check the Host header: probes and Prometheus come
    # with the pod's IP.
    "kvsite.middleware.ProbesAndScrapes",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
    # Innermost, so that the whole chain runs synchronously under ASGI (why: its docstring).
    "kvsite.middleware.SyncMiddlewareChain",
]

ROOT_URLCONF = "kvsite.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = "kvsite.wsgi.application"
ASGI_APPLICATION = "kvsite.asgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'db.sqlite3'}",
        conn_max_age=60,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Ingest writes the registry from two threads (pods heard, their health) while the web
    # processes read it. A transaction takes the write lock when it starts (IMMEDIATE), so it
    # waits its turn instead of failing with "database is locked" when it reads before writing;
    # with the write-ahead log, readers and the writer do not wait for each other.
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL;",
        "timeout": 20,
        # Python keeps 128 prepared statements per connection by default. Statements whose text
        # grows with the pods they name (an IN list, a bulk update) run to ~100 kB each: under a
        # flood of new pods, ingest kept ~12 MB of them (bench/hostile.py's fuzz). 16 hold the
        # queries a process repeats; any other is prepared again (tens of microseconds).
        "cached_statements": 16,
        **DATABASES["default"].get("OPTIONS", {}),
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
# Front-end libraries come from the npm registry (`make node-deps`), never from a CDN or a copy.
STATICFILES_DIRS = [("vendor/uplot", BASE_DIR / "node_modules" / "uplot" / "dist")]

LOGIN_URL = "admin:login"

# --- the index and the channel layer -------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KVCACHE_INDEX_BACKEND = os.environ.get("KVCACHE_INDEX_BACKEND", "redis")
# The index a gateway, an Endpoint Picker or a web server run with ``--index in-process`` keeps in its
# own memory and fills from the engines' KV events itself (ingest/in_process.py): a memory:// URL, whose query
# bounds it (``?max_bytes=2GiB``...).
KVCACHE_IN_PROCESS_INDEX = os.environ.get("KVCACHE_IN_PROCESS_INDEX", "memory://")
# The one-server index's layout: "fast" or "compact" (fewer bytes per entry, more server CPU per
# stored block; kvindex/redis.py). Applied by registry.runtime.index_options.
KVCACHE_INDEX_LAYOUT = os.environ.get("KVCACHE_INDEX_LAYOUT", "fast")
# Seconds a Redis index may take to connect or to reply before the caller gets IndexUnavailable (a
# score: 503 at once rather than a hung request). ``socket_timeout`` / ``socket_connect_timeout`` in
# REDIS_URL win. Ingest has its own: its sliced writes take ~15 ms on the server, but may queue
# behind other clients' work, and a timed-out write is retried whole (ingest/pool.py). Applied by
# registry.runtime.connect_index.
KVCACHE_INDEX_TIMEOUT = float(os.environ.get("KVCACHE_INDEX_TIMEOUT", "1.0"))
KVCACHE_INGEST_INDEX_TIMEOUT = float(os.environ.get("KVCACHE_INGEST_INDEX_TIMEOUT", "10.0"))
# Unset everywhere: what a vLLM >= 0.33 sha256 / sha256_cbor engine without PYTHONHASHSEED hashes
# with (kvindex.keys.DEFAULT_SEED).
KVCACHE_HASH_SEED = os.environ.get("KVCACHE_HASH_SEED", os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
KVCACHE_BLOCK_SIZE = int(os.environ.get("KVCACHE_BLOCK_SIZE", "16"))

# channels-redis waits for a message with a 5 s blocking pop; redis-py's default socket timeout is
# 5 s too, so a quiet channel (no ingest snapshot for 5 s) ended the dashboard's websocket. The
# socket must outwait the pop (a socket_timeout in REDIS_URL's query still wins).
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15}]},
    }
}

# --- the dashboard -------------------------------------------------------------------------
KVCACHE_STATS_GROUP = os.environ.get("KVCACHE_STATS_GROUP", "kvcache-ingest-stats")
DASHBOARD_PUSH_SECONDS = float(os.environ.get("DASHBOARD_PUSH_SECONDS", "1.0"))
DASHBOARD_HISTORY_SECONDS = float(os.environ.get("DASHBOARD_HISTORY_SECONDS", "600"))
DASHBOARD_STALE_SECONDS = float(os.environ.get("DASHBOARD_STALE_SECONDS", "60"))

# --- pod liveness and registry expiry (registry/liveness.py, run by the ingest command) ------------
# Ingest probes GET http://<address>/health of every enabled pod with an address each second (1 s
# timeout). Failing for KVCACHE_POD_DOWN_SECONDS makes a pod down (it leaves scores; one answer
# brings it back); down for KVCACHE_POD_FORGET_SECONDS more clears its blocks from the index.
KVCACHE_POD_DOWN_SECONDS = float(os.environ.get("KVCACHE_POD_DOWN_SECONDS", "10"))
KVCACHE_POD_FORGET_SECONDS = float(os.environ.get("KVCACHE_POD_FORGET_SECONDS", "300"))
# Pods ingest has seen but not heard from for this many days are deleted (not disabled ones).
KVCACHE_POD_EXPIRE_DAYS = float(os.environ.get("KVCACHE_POD_EXPIRE_DAYS", "7"))

# --- the scoring API --------------------------------------------------------------------------
KVCACHE_API_KEYS = env_list("KVCACHE_API_KEYS")
KVCACHE_MAX_BODY_BYTES = int(os.environ.get("KVCACHE_MAX_BODY_BYTES", str(4 * 1024 * 1024)))
KVCACHE_TOKENIZERS_DIR = os.environ.get("KVCACHE_TOKENIZERS_DIR", "")
KVCACHE_ALLOW_HUB = env_bool("KVCACHE_ALLOW_HUB")
KVCACHE_PREFIX_STORE_CAPACITY = int(os.environ.get("KVCACHE_PREFIX_STORE_CAPACITY", "500000"))

# --- abuse limits of the DRF API (registry/api/auth.py, kvsite/drf.py) ----------------------
# A client with KVCACHE_AUTH_FAILURES failed HTTP basic logins within KVCACHE_AUTH_FAILURE_WINDOW_SECONDS
# of its first one is answered 429 (no password checked) until that window ends. Counted in REDIS_URL
# (shared by every process), in each process while it does not answer.
KVCACHE_AUTH_FAILURES = int(os.environ.get("KVCACHE_AUTH_FAILURES", "5"))
KVCACHE_AUTH_FAILURE_WINDOW_SECONDS = float(os.environ.get("KVCACHE_AUTH_FAILURE_WINDOW_SECONDS", "60"))
# Comma-separated addresses or networks (10.0.0.0/8) of reverse proxies: a request from one is
# counted against the client its X-Forwarded-For names; the gateway passes their forwarding headers
# on to the pods (and only theirs); the servers' per-client connection limit spares them (stack.trust).
# Empty: X-Forwarded-For is ignored.
KVCACHE_TRUSTED_PROXIES = env_list("KVCACHE_TRUSTED_PROXIES")

# --- every HTTP connection of manage.py serve and manage.py gateway (stack/asgi_server.py) ----------
# uvicorn bounds only the wait between requests: a client sending its headers or its body a byte at a
# time, or connecting and sending nothing, held a connection (a file descriptor) as long as it liked.
# A request whose headers take longer than KVCACHE_HTTP_HEADER_TIMEOUT from its first byte, or its body
# longer than KVCACHE_HTTP_BODY_TIMEOUT from its headers' end, is answered 408 and its connection
# closed; a connection with no request under way (new, or kept alive) is closed after
# KVCACHE_HTTP_IDLE_TIMEOUT. One client address may hold KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT
# connections in each worker process (the next is answered 429 and closed; 0: no limit); addresses in
# KVCACHE_TRUSTED_PROXIES are free of that limit (every client of a proxy comes from its address).
KVCACHE_HTTP_HEADER_TIMEOUT = float(os.environ.get("KVCACHE_HTTP_HEADER_TIMEOUT", "10"))
KVCACHE_HTTP_BODY_TIMEOUT = float(os.environ.get("KVCACHE_HTTP_BODY_TIMEOUT", "30"))
KVCACHE_HTTP_IDLE_TIMEOUT = float(os.environ.get("KVCACHE_HTTP_IDLE_TIMEOUT", "5"))
KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT = int(
    os.environ.get("KVCACHE_HTTP_MAX_CONNECTIONS_PER_CLIENT", "256")
)
# Deepest nesting of arrays and objects in a request body (deeper: 400 invalid_json). The parsers
# stop at about 1000 levels whatever this says.
KVCACHE_MAX_JSON_DEPTH = int(os.environ.get("KVCACHE_MAX_JSON_DEPTH", "64"))

# --- bounded ingest (ingest/events.py DecodeLimits): past a limit, input is counted and skipped ---
KVCACHE_INGEST_MAX_MESSAGE_BYTES = int(
    os.environ.get("KVCACHE_INGEST_MAX_MESSAGE_BYTES", str(2 * 1024 * 1024))
)
KVCACHE_INGEST_MAX_EVENTS = int(os.environ.get("KVCACHE_INGEST_MAX_EVENTS", "4096"))
KVCACHE_INGEST_MAX_BLOCKS = int(os.environ.get("KVCACHE_INGEST_MAX_BLOCKS", "65536"))
# Registered pods (the admin, the API, simulate --register, a pod selector) are always admitted;
# unregistered ones (known only from their events) at most KVCACHE_INGEST_MAX_PODS at once, and
# one quiet for KVCACHE_INGEST_POD_IDLE_SECONDS gives its place, its row and its blocks to a new
# one (ingest/pool.py Admission). KVCACHE_INGEST_REGISTERED_PODS_ONLY: the registry is the
# allow-list of the event port (a message of a pod not registered for its model is refused).
KVCACHE_INGEST_MAX_PODS = int(os.environ.get("KVCACHE_INGEST_MAX_PODS", "4096"))
KVCACHE_INGEST_POD_IDLE_SECONDS = float(os.environ.get("KVCACHE_INGEST_POD_IDLE_SECONDS", "600"))
KVCACHE_INGEST_REGISTERED_PODS_ONLY = env_bool("KVCACHE_INGEST_REGISTERED_PODS_ONLY")
# Ingest records each block it keys from token ids as NVIDIA Dynamo's indexer hashes it (its
# parent, its XXH3 block hash: kvindex/dynamo.py), beside the index (on REDIS_URL for a Redis
# index), so that /kv-indexer/dump lists the blocks as Dynamo's own dump does and a Dynamo indexer
# can recover from us (python -m dynamo.indexer --peers http://<web>/kv-indexer). Off: the dump's
# events are empty. Costs ~28 bytes a block in Redis plus its hash entry, and an XXH3 a block.
# Applied by registry.runtime.dynamo_blocks_factory.
KVCACHE_DYNAMO_BLOCKS = env_bool("KVCACHE_DYNAMO_BLOCKS")
# CURVE on the KV-event sockets (ingest/curve.py; certificates from manage.py curve_keys), off
# unless the secret key file is set. Ingest's own key pair; the directory of the engines' public
# certificates (NAME.key) its bound SUB sockets (--bind, where it is the CURVE server) admit, read
# at start; the engines' shared public key for the sockets it connects (--connect, the replicas'
# event endpoints: required with them; the replay DEALER: over CURVE only when it is set).
# Missing or malformed files are refused when ingest starts.
KVCACHE_INGEST_CURVE_SECRET_KEY_FILE = os.environ.get("KVCACHE_INGEST_CURVE_SECRET_KEY_FILE", "")
KVCACHE_INGEST_CURVE_CLIENTS_DIR = os.environ.get("KVCACHE_INGEST_CURVE_CLIENTS_DIR", "")
KVCACHE_INGEST_CURVE_SERVER_KEY_FILE = os.environ.get("KVCACHE_INGEST_CURVE_SERVER_KEY_FILE", "")

# --- the OpenAI gateway (gateway/, manage.py gateway) --------------------------------------------
KVCACHE_GATEWAY_POLICY = os.environ.get("KVCACHE_GATEWAY_POLICY", "kv-load")
# kv-load's weight of one in-flight request against a whole prefix hit (0.1: ten requests of queue)
KVCACHE_GATEWAY_ALPHA = float(os.environ.get("KVCACHE_GATEWAY_ALPHA", "0.25"))
# after routing, the chosen pod is taken to hold the request's blocks this long (until its events)
KVCACHE_SPECULATIVE_SECONDS = float(os.environ.get("KVCACHE_SPECULATIVE_SECONDS", "2.0"))
# next pods tried after a connect error or a 5xx before the first byte
KVCACHE_GATEWAY_RETRIES = int(os.environ.get("KVCACHE_GATEWAY_RETRIES", "2"))
# Seconds to connect to a pod (then the next pod is tried), and for its answer to begin (then 504, no
# retry: the pod may still be working on it). A non-streaming completion's answer begins when it is
# done, so the second bounds the longest one.
KVCACHE_GATEWAY_CONNECT_TIMEOUT = float(os.environ.get("KVCACHE_GATEWAY_CONNECT_TIMEOUT", "2.0"))
KVCACHE_GATEWAY_FIRST_BYTE_TIMEOUT = float(os.environ.get("KVCACHE_GATEWAY_FIRST_BYTE_TIMEOUT", "300"))
# The gateway takes KVCACHE_API_KEYS (every path but /health). To the pods it sends the client's
# Authorization header, or "Bearer <this key>" instead when it is set (vLLM's --api-key).
KVCACHE_GATEWAY_POD_API_KEY = os.environ.get("KVCACHE_GATEWAY_POD_API_KEY", "")
# x-kvcache-matched-blocks tells a client how many blocks of its prompt the chosen pod was known to
# hold: whether a guessed prefix (another tenant's prompt) is cached. Off unless every client may know
# that (make run's demo turns it on; cache_salt keeps tenants apart whatever this says).
KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER = env_bool("KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER")
# Prefill/decode disaggregation (routing/disaggregation.py): a request of a model whose live pods
# include prefill and decode pods (Pod.role) goes first to a prefill pod, then to a decode pod; but
# one whose chosen decode pod would compute fewer than this many of its prompt tokens skips the
# prefill step (the extra hop costs more than a short prefill: Dynamo's max_local_prefill_length).
KVCACHE_PD_THRESHOLD_TOKENS = int(os.environ.get("KVCACHE_PD_THRESHOLD_TOKENS", "0"))
# Seconds for a prefill pod's whole answer (it comes when the prompt is computed); then, as after a
# connect error or a 5xx of every prefill pod tried, the decode pod serves the request whole.
KVCACHE_PD_PREFILL_TIMEOUT = float(os.environ.get("KVCACHE_PD_PREFILL_TIMEOUT", "60"))
# The gateways whose /metrics the dashboard adds to its scoring traffic (requests/s, hit rate).
KVCACHE_GATEWAY_URLS = [url.rstrip("/") for url in env_list("KVCACHE_GATEWAY_URLS")]

# --- replay of missed KV-event batches (ingest/replay.py, ingest/resync.py) ---------------------
KVCACHE_REPLAY_TIMEOUT_SECONDS = float(os.environ.get("KVCACHE_REPLAY_TIMEOUT_SECONDS", "2.0"))
# A pod without a registry replay_endpoint replays at tcp://host:(port + this) of its address.
KVCACHE_REPLAY_PORT_OFFSET = (
    int(os.environ["KVCACHE_REPLAY_PORT_OFFSET"]) if os.environ.get("KVCACHE_REPLAY_PORT_OFFSET") else None
)

# --- bounded work per scoring request (the fast path: scoring/fastpath/app.py) ---------------------
KVCACHE_LARGE_PROMPT_CHARS = int(os.environ.get("KVCACHE_LARGE_PROMPT_CHARS", str(256 * 1024)))
KVCACHE_SCORING_THREADS = int(os.environ.get("KVCACHE_SCORING_THREADS", "8"))
KVCACHE_REQUEST_TEMPLATES = env_bool("KVCACHE_REQUEST_TEMPLATES", True)
KVCACHE_TEMPLATE_CPU_MS = float(os.environ.get("KVCACHE_TEMPLATE_CPU_MS", "250"))
KVCACHE_TEMPLATE_MAX_OUTPUT_CHARS = int(
    os.environ.get("KVCACHE_TEMPLATE_MAX_OUTPUT_CHARS", str(4 * 1024 * 1024))
)
KVCACHE_TEMPLATE_PROCESSES = int(os.environ.get("KVCACHE_TEMPLATE_PROCESSES", "1"))

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # Safe defaults: a view that says nothing is for staff only (the registry API is the API's only
    # set of DRF views: the scoring endpoints are the fast path's, with their API keys); see
    # registry/api/auth.py.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "registry.api.auth.ThrottledBasicAuthentication",
    ],
    # JSON only (no view takes forms or files), size- and depth-limited: see kvsite/drf.py.
    "DEFAULT_PARSER_CLASSES": ["kvsite.drf.BoundedJSONParser"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"],
    "EXCEPTION_HANDLER": "kvsite.drf.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "KV-cache aware routing service",
    "DESCRIPTION": (
        "Per-pod KV-cache prefix scores for LLM request routing. Scoring endpoints need "
        "`Authorization: Bearer <key>` when KVCACHE_API_KEYS is set; registry endpoints need a staff "
        "login (session or HTTP basic)."
    ),
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI and ReDoc assets from the drf-spectacular-sidecar package: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The fast path's endpoints (not Django views) are added to the schema here.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "scoring.fastpath.openapi.add_fast_path",
    ],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    # httpx logs every request at INFO: the liveness prober alone sends one per pod a second.
    "loggers": {"httpx": {"level": "WARNING"}},
}
