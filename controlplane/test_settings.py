"""Settings for the test suite: the real settings, with fast password hashing.

The database still comes from DATABASE_URL, so the same suite runs against SQLite (default)
and PostgreSQL (CI sets DATABASE_URL=postgres://...).
"""

import os

from controlplane.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# On SQLite the test database is a file, not memory, so that processes the tests start (a Celery
# worker, gunicorn) can open it too; one per test run, so parallel runs never share one.
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    DATABASES["default"]["TEST"] = {  # noqa: F405
        "NAME": str(LOCAL_DIR / f"test-{os.getpid()}.sqlite3")  # noqa: F405
    }
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}

# WhiteNoise looks for collected files at start-up; tests serve none, so give it an empty folder.
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # noqa: F405

# A fixed, public test key for the allocation signature (never a production key), and no
# snapshot cache: each filter reads the committed ledger (tests of the cache switch it on).
TESSERA = {
    **TESSERA,  # noqa: F405
    "ALLOCATION_KEY": "tessera-test-allocation-key-0123456789abcdef",
    "ALLOCATION_KEY_FILE": "",
    "FILTER_SNAPSHOT_TTL_MS": 0,
    "SERVE_EXTENDER": True,
    "DECISION_LOG_ASYNC": False,
    "CONFIRM_ASYNC": False,
    "EVENTS_ASYNC": False,
    "PREEMPTION": False,
}
