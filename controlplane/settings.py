"""Tessera control-plane settings, driven by the environment.

Every knob has a safe embedded default (SQLite under `.local/`, no cluster = the embedded
Kubernetes stand-in), so `make run` works on a bare machine. Production (`TESSERA_ENV=production`)
refuses the development secret key and the embedded stand-in.

Environment variables (all optional):
  TESSERA_ENV            dev | test | production            (default: dev)
  TESSERA_SECRET_KEY     Django secret key                   (required in production)
  TESSERA_DEBUG          1/0                                 (default: 0)
  TESSERA_ALLOWED_HOSTS  comma list                          (default: 127.0.0.1,localhost,[::1])
  DATABASE_URL           e.g. postgres://user:pw@host:5432/db (default: sqlite:///.local/tessera.sqlite3)
  TESSERA_DB_SERVER_SIDE_BINDING  PostgreSQL: 1 (default) prepared statements; 0: old PgBouncer
  TESSERA_DB_POOL_MAX    PostgreSQL: connections one process's pool may open (default: 32)
  REDIS_URL              Celery broker / locks               (default: redis://127.0.0.1:6379/0)
  TESSERA_KUBE_MODE      auto | kubeconfig | incluster | embedded   (default: auto)
  KUBECONFIG             kubeconfig path for mode kubeconfig (auto picks it when it exists)
  TESSERA_RESOURCE_GPU / _GPUMEM / _GPUMEM_PERCENTAGE / _GPUCORES / _PRIORITY   resource names
  TESSERA_DEFAULT_GPUMEM_MIB, TESSERA_DEFAULT_GPUMEM_PERCENTAGE, TESSERA_DEFAULT_GPUCORES,
  TESSERA_DEFAULT_SLOTS, TESSERA_DEFAULT_NODE_POLICY, TESSERA_DEFAULT_GPU_POLICY,
  TESSERA_DEFAULT_VGPU_MODES, TESSERA_MIG_RESOURCES
  TESSERA_RESERVATION_TIMEOUT_S  how long a reservation may wait for its Binding (default 120)
  TESSERA_CSRF_TRUSTED_ORIGINS   the dashboard's public origins behind an ingress (https://...)
  TESSERA_BEHIND_TLS_PROXY       1: trust X-Forwarded-Proto and X-Forwarded-For from the ingress
  TESSERA_HSTS_SECONDS           Strict-Transport-Security max-age on HTTPS responses (default:
                                 31536000 in production, 0 = none elsewhere)
  TESSERA_HSTS_INCLUDE_SUBDOMAINS, TESSERA_HSTS_PRELOAD   1: add those HSTS flags (default 0)
  TESSERA_PROXY_HOPS             proxies that append to X-Forwarded-For before the control plane
                                 (default 1: the ingress); the client address is the entry the
                                 outermost one added
  TESSERA_LOGIN_FAILURE_LIMIT    failed sign-ins of one username from one address before that
                                 pair is locked out (default 5); /login/ and /admin/login/
  TESSERA_LOGIN_COOLOFF_S        how long a lockout lasts, restarted by each refused attempt
                                 (default 900); API tokens are never throttled
  TESSERA_PRUNE_PERIOD_S         how often beat sends the prune task (default 300)
  TESSERA_MISSING_CARD_RETENTION_S  cards missing from their node's reports and used by no active
                                 slice are deleted after this long (default 604800, 7 days)
  TESSERA_MISSING_CARDS_PER_NODE most such cards kept per node; the longest missing beyond it are
                                 deleted at the report (default 64)
  TESSERA_DECISION_RETENTION_S   decision log entries older than this are deleted (default 86400);
                                 those of bound or deleted pods at the next prune or reconcile
  TESSERA_PRUNE_BATCH            most rows of one kind deleted per prune or reconcile pass (5000)
  TESSERA_NODE_SERVICE_ACCOUNTS  node plugin ServiceAccounts ("ns:name,...") for TokenReview
  TESSERA_ADOPTED_SCHEDULERS     schedulers whose GPU pods go to Tessera's (default:
                                 default-scheduler); pods naming any other are left alone
  TESSERA_MODE                   extender (default): Tessera's scheduler extender places GPU pods;
                                 dra: kube-scheduler allocates from ResourceSlices (docs/dra.md)
                                 and the webhook turns HAMi-style pods into ResourceClaims
  TESSERA_CARD_MODE_DEFAULTS     the mode a card starts in when it first registers: a JSON list
                                 of {"model": "<substring>", "mode": "shared|mig|mps|exclusive"},
                                 first match wins (default []: every card starts shared)
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path

import dj_database_url
from csp.constants import NONE, SELF
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
LOCAL_DIR = Path(os.environ.get("TESSERA_LOCAL_DIR", BASE_DIR / ".local"))

DEV_SECRET_KEY = "tessera-insecure-dev-key-never-use-in-production"  # noqa: S105 - a marker, refused in production


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default).strip()


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def env_int(name: str, default: int | None, *, low: int, high: int) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r}: expected a whole number") from None
    if not low <= value <= high:
        raise ImproperlyConfigured(f"{name}={value}: expected a number from {low} to {high}")
    return value


def env_names(name: str, default: str) -> tuple[str, ...]:
    """A comma list of names (empty allowed), each a Kubernetes object name."""
    raw = os.environ.get(name, default)
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    for item in names:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", item):
            raise ImproperlyConfigured(
                f"{name}={raw!r}: {item!r} is not a Kubernetes name (lower-case letters, "
                "digits, '-' and '.'; comma-separated)"
            )
    return names


def env_modes(name: str, default: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list of at least one of `choices`, order kept, repeats dropped; blank: the
    default."""
    raw = os.environ.get(name, "").strip() or default
    modes = tuple(dict.fromkeys(p.strip().lower() for p in raw.split(",") if p.strip()))
    unknown = [m for m in modes if m not in choices]
    if unknown or not modes:
        raise ImproperlyConfigured(
            f"{name}={raw!r}: expected a comma list of {', '.join(choices)} (at least one)"
        )
    return modes


# The card modes (controlplane.ledger.models.Card.Mode; a test holds the two lists equal: settings
# load before the apps, so they cannot import the model).
CARD_MODES = ("shared", "mig", "mps", "exclusive")
MAX_CARD_MODE_RULES = 64


def env_card_mode_defaults(name: str) -> tuple[dict[str, str], ...]:
    """A JSON list of {"model": <substring>, "mode": <card mode>}; refused at start, naming the
    rule and the key at fault, rather than a card registered in a mode nobody meant."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return ()
    try:
        rules = json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}: not JSON ({exc}); expected a JSON list") from None
    if not isinstance(rules, list) or len(rules) > MAX_CARD_MODE_RULES:
        raise ImproperlyConfigured(
            f"{name}: expected a JSON list of at most {MAX_CARD_MODE_RULES} rules like "
            '{"model": "A100", "mode": "mig"}'
        )
    out = []
    for position, rule in enumerate(rules):
        where = f"{name}[{position}]"
        if not isinstance(rule, dict) or set(rule) != {"model", "mode"}:
            raise ImproperlyConfigured(
                f'{where}: expected an object with exactly "model" and "mode", got {rule!r}'
            )
        model, mode = rule["model"], rule["mode"]
        if not isinstance(model, str) or not model.strip() or len(model) > 128:
            raise ImproperlyConfigured(
                f"{where}.model: expected a non-empty part of a card's model name (at most 128 "
                f"characters), got {model!r}"
            )
        if mode not in CARD_MODES:
            raise ImproperlyConfigured(
                f"{where}.mode: {mode!r} is not a card mode; expected one of "
                f"{', '.join(CARD_MODES)}"
            )
        out.append({"model": model.strip(), "mode": mode})
    return tuple(out)


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env_str(name, default).lower()
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


TESSERA_ENV = env_choice("TESSERA_ENV", "dev", ("dev", "test", "production"))
PRODUCTION = TESSERA_ENV == "production"

SECRET_KEY = os.environ.get("TESSERA_SECRET_KEY", "") or DEV_SECRET_KEY
if PRODUCTION and (SECRET_KEY == DEV_SECRET_KEY or len(SECRET_KEY) < 50):
    raise ImproperlyConfigured(
        "TESSERA_ENV=production needs TESSERA_SECRET_KEY set to a random string of at least "
        "50 characters (e.g. from a Kubernetes Secret); the development key is refused."
    )

DEBUG = env_bool("TESSERA_DEBUG", False)
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("TESSERA_DEBUG must be off when TESSERA_ENV=production")

ALLOWED_HOSTS = [
    h.strip()
    for h in env_str("TESSERA_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")
    if h.strip()
]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "axes",
    "controlplane.access",
    "controlplane.ledger",
    "controlplane.kube",
    "controlplane.extender",
    "controlplane.dashboard",
    "controlplane.reconciler",
    "controlplane.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    "controlplane.middleware.BodySizeLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: it turns a refused sign-in into the locked-out page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
WSGI_APPLICATION = "controlplane.wsgi.application"

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
                "controlplane.dashboard.context_processors.tessera_role",
            ],
        },
    },
]

DEFAULT_DATABASE_URL = f"sqlite:///{LOCAL_DIR / 'tessera.sqlite3'}"
DATABASE_URL = env_str("DATABASE_URL", "") or DEFAULT_DATABASE_URL
if DATABASE_URL.split(":", 1)[0] not in {"sqlite", "postgres", "postgresql", "pgsql"}:
    raise ImproperlyConfigured(
        f"DATABASE_URL scheme {DATABASE_URL.split(':', 1)[0]!r} is not supported: "
        "use sqlite:///path or postgres://user:password@host:port/name"
    )
# A request holds a connection only while it runs (CONN_MAX_AGE 0: PostgreSQL's pool, below,
# requires it), and a connection is checked before a request uses one: a database restart or
# failover ends them all, and without the check the next request would fail on a dead connection
# (a webhook refusal, a failed scheduling cycle, an error page) before Django noticed.
DATABASES = {
    "default": dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=True)
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several threads/processes (gunicorn workers, the demo) share the file: wait for locks
    # instead of failing at once, and take the write lock at BEGIN so lock -> recompute -> commit
    # cannot be interleaved.
    # WAL lets readers (filter, dashboard) run while one writer commits; NORMAL sync is safe
    # under WAL (a power cut may lose the last commits, never corrupt the file).
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Parameters bound by the server (not interpolated into the SQL text by psycopg), so the
    # statements bind runs for every pod are prepared once per connection and then only
    # executed. Off for a pooler that cannot keep prepared statements (PgBouncer < 1.21 in
    # transaction mode): TESSERA_DB_SERVER_SIDE_BINDING=0.
    # Django turns psycopg's statement preparation off (prepare_threshold None) for poolers'
    # sake; without it every statement is parsed and planned anew, which was
    # about half the database server's CPU per scheduled pod. psycopg's own threshold: 5 runs.
    prepared = env_bool("TESSERA_DB_SERVER_SIDE_BINDING", True)
    # Django's connection pool (psycopg_pool), one per process: a request takes a connection and
    # gives it back when it ends; the backend checks it at checkout (controlplane/pgpool: what
    # CONN_HEALTH_CHECKS would install finds a restarted server's dead connections one backoff
    # step at a time). Connections stay open in the pool between requests, their prepared
    # statements with them; past one, a connection idle for a minute is closed. No thread holds a
    # connection between requests, so a thread an app server ends (granian ends idle blocking
    # threads of the extender sidecar) leaves none open behind it. `max_size` bounds one process's
    # connections: above the threads of the busiest process that use the database at once (the
    # sidecar's 16 request threads and its background writers); a request past it waits for one.
    DATABASES["default"]["ENGINE"] = "controlplane.pgpool"
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = False
    pool = {
        "min_size": 1,
        "max_size": env_int("TESSERA_DB_POOL_MAX", 32, low=2, high=1000),
        "max_idle": 60.0,
    }
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        server_side_binding=prepared, prepare_threshold=5 if prepared else None, pool=pool
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")

# --- Celery (reconciler): broker Redis, no result backend (tasks report through the ledger) ----
RECONCILE_PERIOD_S = env_int("TESSERA_RECONCILE_PERIOD_S", 15, low=1, high=3600)
CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True  # a task whose worker dies is redelivered, not lost
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None  # Redis away for a while: keep trying
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 300}
CELERY_TASK_DEFAULT_QUEUE = "tessera"
# Retention (docs/reconciler.md, "Pruning"): missing cards, the decision log, expired sessions.
PRUNE_PERIOD_S = env_int("TESSERA_PRUNE_PERIOD_S", 300, low=1, high=86400)
CELERY_BEAT_SCHEDULE = {
    "reconcile": {
        "task": "controlplane.reconciler.tasks.reconcile",
        "schedule": float(RECONCILE_PERIOD_S or 15),
        # A reconcile that waited longer than a period is superseded by the next one.
        "options": {"expires": float(RECONCILE_PERIOD_S or 15)},
    },
    "prune": {
        "task": "controlplane.reconciler.tasks.prune",
        "schedule": float(PRUNE_PERIOD_S or 300),
        "options": {"expires": float(PRUNE_PERIOD_S or 300)},
    },
}
CELERY_BEAT_SCHEDULE_FILENAME = str(LOCAL_DIR / "celerybeat-schedule")

# django-axes' backend first: it refuses a sign-in while its username and address are locked out,
# before the password is checked. API tokens never pass through here (they are not passwords).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = LOCAL_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if not DEBUG
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}

# Request bodies: an inventory report of 64 cards is a few KiB; anything near 1 MiB is abuse.
DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024

# Behind an HTTPS ingress: the dashboard's public origin(s) for CSRF, and trust the proxy's
# X-Forwarded-Proto only when told to (a client could forge it otherwise).
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in env_str("TESSERA_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]
for _origin in CSRF_TRUSTED_ORIGINS:
    if not _origin.startswith(("https://", "http://")):
        raise ImproperlyConfigured(
            f"TESSERA_CSRF_TRUSTED_ORIGINS: {_origin!r} needs its scheme, e.g. https://{_origin}"
        )
BEHIND_TLS_PROXY = env_bool("TESSERA_BEHIND_TLS_PROXY", False)
if BEHIND_TLS_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# HSTS: on by default in production, and only ever sent with HTTPS responses (Django's
# SecurityMiddleware adds it when the request is secure: the control plane's own TLS listener, or
# the ingress's X-Forwarded-Proto under TESSERA_BEHIND_TLS_PROXY), so a plain-HTTP port-forward
# or probe never pins anything. Browsers then refuse plain HTTP to the host for that long.
SECURE_HSTS_SECONDS = env_int(
    "TESSERA_HSTS_SECONDS", 31536000 if PRODUCTION else 0, low=0, high=2 * 31536000
)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("TESSERA_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("TESSERA_HSTS_PRELOAD", False)

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = PRODUCTION
# The CSRF token lives in the session, not in a cookie of its own: it is good only for the
# session it was issued to (a cookie planted from a sibling host cannot pair with a forged
# form) and is replaced at sign-in. Pages put it in their forms; nothing reads it from a cookie.
CSRF_USE_SESSIONS = True
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True

# Content-Security-Policy on every response (django-csp), in every environment: the pages load
# only this origin's files. No 'unsafe-inline': the dashboard's script is static/dashboard/
# tessera.js, bar widths are set through the CSSOM from data-width, htmx is told not to inject
# its indicator <style> or eval anything (templates/base.html). tests/dashboard/browser checks
# that no page, the admin's included, reports a violation.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF],
        "img-src": [SELF],
        "font-src": [SELF],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    },
}

# --- Sign-in throttling (django-axes; docs/operator-guide.md, "Sign-in throttling") -------------
# Failed sign-ins at /login/ and /admin/login/ are counted per username *and* client address, in
# the database (so every replica sees the same count). After TESSERA_LOGIN_FAILURE_LIMIT of them
# that pair is refused (429, with Retry-After) for TESSERA_LOGIN_COOLOFF_S, and each attempt during
# the lockout starts the cool-off again; the same person from elsewhere, and everyone else, can
# still sign in. A successful sign-in clears the count. Unlock early: the admin's "Access
# attempts", or `manage.py axes_reset_username <name>`.
AXES_FAILURE_LIMIT = env_int("TESSERA_LOGIN_FAILURE_LIMIT", 5, low=1, high=1000)
AXES_COOLOFF_TIME = timedelta(
    seconds=env_int("TESSERA_LOGIN_COOLOFF_S", 900, low=1, high=30 * 86400) or 900
)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# No row per successful sign-in (Django keeps each user's last_login): the tables stay bounded,
# since axes deletes attempts older than the cool-off whenever it counts one.
AXES_DISABLE_ACCESS_LOG = True
AXES_LOCKOUT_CALLABLE = "controlplane.access.signin.locked_out"
# The address a guess came from: the peer, or behind the TLS proxy the address that proxy put in
# X-Forwarded-For (controlplane.access.signin.client_ip), never a header a client chose.
AXES_CLIENT_IP_CALLABLE = "controlplane.access.signin.client_ip"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.access.authentication.BearerTokenAuthentication",
        "controlplane.access.serviceaccount.ServiceAccountTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.access.permissions.IsViewer"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["controlplane.api.parsers.JSONParser"],  # with a depth limit
    "EXCEPTION_HANDLER": "controlplane.api.errors.exception_handler",
    "DEFAULT_METADATA_CLASS": "controlplane.api.metadata.Metadata",  # OPTIONS without get_object
    "DEFAULT_SCHEMA_CLASS": "controlplane.api.schema.AutoSchema",  # with the error answers
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Tessera control plane API",
    "DESCRIPTION": "Ledger of GPU nodes, cards, slices and pod bindings; node inventory reports.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # links from answers to the operations that take the names in them (controlplane.api.schema)
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "controlplane.api.schema.add_links",
    ],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("TESSERA_LOG_LEVEL", "INFO").upper()},
}


# --- Kubernetes connection (DESIGN §7) ----------------------------------------------------------
def _kube_mode() -> tuple[str, str]:
    mode = env_choice("TESSERA_KUBE_MODE", "auto", ("auto", "kubeconfig", "incluster", "embedded"))
    kubeconfig = env_str("KUBECONFIG", str(Path.home() / ".kube" / "config"))
    if mode == "auto":
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            mode = "incluster"
        elif kubeconfig and Path(kubeconfig).is_file():
            mode = "kubeconfig"
        else:
            mode = "embedded"
    if mode == "kubeconfig" and not Path(kubeconfig).is_file():
        raise ImproperlyConfigured(
            f"TESSERA_KUBE_MODE=kubeconfig but KUBECONFIG={kubeconfig!r} is not a readable file"
        )
    if PRODUCTION and mode == "embedded":
        raise ImproperlyConfigured(
            "TESSERA_ENV=production needs a real cluster: the embedded Kubernetes stand-in is a "
            "demo and test aid. Run in-cluster or set KUBECONFIG."
        )
    return mode, kubeconfig


_mode, _kubeconfig = _kube_mode()

#: The cluster's scheduling mode (docs/dra.md): the chart sets it from `.Values.mode`.
TESSERA_MODES = ("extender", "dra")


def env_tessera_mode() -> str:
    """TESSERA_MODE, exactly as the chart's `mode` spells it (case-sensitive, like the chart):
    a typo must stop the control plane rather than run the other mode's webhook."""
    raw = os.environ.get("TESSERA_MODE", "").strip()
    if not raw:
        return "extender"
    if raw not in TESSERA_MODES:
        raise ImproperlyConfigured(
            f"TESSERA_MODE={raw!r} is not a mode Tessera runs: use extender (Tessera's scheduler "
            "extender places GPU pods) or dra (kube-scheduler allocates Tessera's ResourceSlices)"
        )
    return raw


# --- Tessera knobs: one namespace ---------------------------------------------------------------
TESSERA = {
    "KUBE_MODE": _mode,
    # extender | dra: only code that must differ by mode reads it (the admission webhook).
    "MODE": env_tessera_mode(),
    "KUBECONFIG": _kubeconfig if _mode == "kubeconfig" else "",
    "RESOURCES": {
        "gpu": env_str("TESSERA_RESOURCE_GPU", "nvidia.com/gpu"),
        "gpumem": env_str("TESSERA_RESOURCE_GPUMEM", "nvidia.com/gpumem"),
        "gpumem_percentage": env_str(
            "TESSERA_RESOURCE_GPUMEM_PERCENTAGE", "nvidia.com/gpumem-percentage"
        ),
        "gpucores": env_str("TESSERA_RESOURCE_GPUCORES", "nvidia.com/gpucores"),
        "priority": env_str("TESSERA_RESOURCE_PRIORITY", "nvidia.com/priority"),
    },
    "DEFAULT_GPUMEM_MIB": env_int("TESSERA_DEFAULT_GPUMEM_MIB", None, low=1, high=16 * 1024 * 1024),
    "DEFAULT_GPUMEM_PERCENTAGE": env_int(
        "TESSERA_DEFAULT_GPUMEM_PERCENTAGE", None, low=1, high=100
    ),
    "DEFAULT_GPUCORES": env_int("TESSERA_DEFAULT_GPUCORES", 0, low=0, high=100),
    "DEFAULT_SLOTS": env_int("TESSERA_DEFAULT_SLOTS", 10, low=1, high=128),
    "DEFAULT_NODE_POLICY": env_choice(
        "TESSERA_DEFAULT_NODE_POLICY", "binpack", ("binpack", "spread")
    ),
    "DEFAULT_GPU_POLICY": env_choice("TESSERA_DEFAULT_GPU_POLICY", "spread", ("binpack", "spread")),
    # --- card modes (docs/card-modes.md) ---
    # The modes a pod without nvidia.com/vgpu-mode accepts, HAMi's names (HAMi's own default
    # is "hami-core,mig").
    "DEFAULT_VGPU_MODES": env_modes(
        "TESSERA_DEFAULT_VGPU_MODES", "hami-core", ("hami-core", "mig", "mps")
    ),
    # Serve NVIDIA's nvidia.com/mig-<profile> resources: off where NVIDIA's device plugin owns
    # those names (the webhook then leaves such pods alone, as HAMi does).
    "MIG_RESOURCES": env_bool("TESSERA_MIG_RESOURCES", False),
    "RESERVATION_TIMEOUT_S": env_int("TESSERA_RESERVATION_TIMEOUT_S", 120, low=5, high=3600),
    "NODE_STALE_AFTER_S": env_int("TESSERA_NODE_STALE_AFTER_S", 120, low=10, high=86400),
    "DECISION_LOG_MAX_NODES": 50,
    # --- retention (docs/reconciler.md, "Pruning") ---
    # Cards gone from their node's reports, no active slice on them: deleted after this long.
    "MISSING_CARD_RETENTION_S": env_int(
        "TESSERA_MISSING_CARD_RETENTION_S", 7 * 86400, low=60, high=365 * 86400
    ),
    # ... and at once beyond this many per node (longest missing first): a plugin that reports
    # ever-new UUIDs cannot grow the ledger without bound between two prunes.
    "MISSING_CARDS_PER_NODE": env_int("TESSERA_MISSING_CARDS_PER_NODE", 64, low=0, high=4096),
    # Decision log entries older than this are deleted (a pending pod's is rewritten at each
    # filter, every few minutes at most); those of pods bound or gone go at the next prune.
    "DECISION_RETENTION_S": env_int("TESSERA_DECISION_RETENTION_S", 86400, low=60, high=90 * 86400),
    # Most rows of one kind one prune (or one reconcile pass) deletes; the next one goes on.
    "PRUNE_BATCH": env_int("TESSERA_PRUNE_BATCH", 5000, low=1, high=1_000_000),
    # Behind an ingress: how many proxies append to X-Forwarded-For in front of the control plane
    # (the client address for sign-in throttling is the entry the outermost of them added).
    "BEHIND_TLS_PROXY": BEHIND_TLS_PROXY,
    "PROXY_HOPS": env_int("TESSERA_PROXY_HOPS", 1, low=1, high=10),
    # Node plugins in a cluster: their ServiceAccounts, "namespace:name" comma list (TokenReview)
    "NODE_SERVICE_ACCOUNTS": env_str("TESSERA_NODE_SERVICE_ACCOUNTS", ""),
    # reconciler
    "RECONCILE_LOCK_TTL_S": env_int("TESSERA_RECONCILE_LOCK_TTL_S", 120, low=10, high=3600),
    "FULL_RESYNC_S": env_int("TESSERA_FULL_RESYNC_S", 300, low=0, high=86400),
    "WATCH_TIMEOUT_S": env_int("TESSERA_WATCH_TIMEOUT_S", 2, low=1, high=60),
    "LIST_PAGE_SIZE": env_int("TESSERA_LIST_PAGE_SIZE", 500, low=10, high=5000),
    # --- extender and admission webhook (docs/extender.md) ---
    # /scheduler/* is served only when on, and then only to loopback peers (the scheduler's
    # sidecar). Off by default in production: ordinary replicas never answer the extender.
    "SERVE_EXTENDER": env_bool("TESSERA_SERVE_EXTENDER", not PRODUCTION),
    "SCHEDULER_NAME": env_str("TESSERA_SCHEDULER_NAME", "tessera-scheduler"),
    # Schedulers whose GPU pods the webhook moves to Tessera's (besides pods that name none).
    # A GPU pod naming any other scheduler (Volcano, KAI, ...) is left untouched, as HAMi does;
    # empty: only pods that name no scheduler or Tessera's own.
    "ADOPTED_SCHEDULERS": env_names("TESSERA_ADOPTED_SCHEDULERS", "default-scheduler"),
    # The mode a card starts in when it first registers (docs/card-modes.md); first match wins.
    "CARD_MODE_DEFAULTS": env_card_mode_defaults("TESSERA_CARD_MODE_DEFAULTS"),
    # HMAC key for the allocation annotation (docs/allocation.md). Production reads the file;
    # the plain variable is for dev/test; with neither, dev generates .local/allocation.key.
    "ALLOCATION_KEY_FILE": env_str("TESSERA_ALLOCATION_KEY_FILE", ""),
    "ALLOCATION_KEY": os.environ.get("TESSERA_ALLOCATION_KEY", ""),
    # Filter/prioritize read a per-process snapshot at most this old (0 = always re-read).
    "FILTER_SNAPSHOT_TTL_MS": env_int("TESSERA_FILTER_SNAPSHOT_TTL_MS", 250, low=0, high=5000),
    # Write the decision log from a background thread, off the filter's hot path.
    "DECISION_LOG_ASYNC": env_bool("TESSERA_DECISION_LOG_ASYNC", True),
    # Confirm bound reservations from a background thread in batches, off bind's path (never
    # dropped: ledger/services/confirmations.py).
    "CONFIRM_ASYNC": env_bool("TESSERA_CONFIRM_ASYNC", True),
    "EVENTS_ASYNC": env_bool("TESSERA_EVENTS_ASYNC", True),
    # Tessera's own preemption for pods unschedulable for want of GPU room (docs/preemption.md)
    "PREEMPTION": env_bool("TESSERA_PREEMPTION", True),
    # Largest extender / webhook body read (a v1.Pod plus NodeNames of a big cluster).
    "EXTENDER_MAX_BODY": env_int(
        "TESSERA_EXTENDER_MAX_BODY", 1024 * 1024, low=64 * 1024, high=64 * 1024 * 1024
    ),
}
