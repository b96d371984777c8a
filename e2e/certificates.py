"""The harness's certificates, made with openssl: a CA of its own, the serving certificates of
the API server and the webhook, the client certificates of its identities, the service-account
signing key, and the kubeconfigs that name them.

Every key is EC P-256 (the SA key: RSA 2048), valid for 7 days, readable by its owner only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from e2e.harness import HarnessError

EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def openssl(*args: str, cwd: Path) -> None:
    """Run `openssl args...` in `cwd`; a failure raises with openssl's own words."""
    if shutil.which("openssl") is None:
        raise HarnessError("openssl not found: install it (Debian: apt-get install openssl)")
    proc = subprocess.run(  # noqa: S603
        ["openssl", *args],  # noqa: S607 - found on PATH above
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise HarnessError(f"openssl {args[0]} failed: {proc.stderr.strip()}")


def sign_leaf(pki: Path, name: str, subject: str, usage: str, san: str = "") -> None:
    """`<name>.key` and `<name>.crt` in `pki`, signed by its CA: subject `subject`, extended key
    usage `usage` (serverAuth or clientAuth), and subjectAltName `san` when given."""
    ext = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if san:
        ext.append(f"subjectAltName={san}")
    (pki / f"{name}.ext").write_text("\n".join(ext) + "\n")
    openssl("req", "-new", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", subject, cwd=pki)  # fmt: skip
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "7", "-extfile", f"{name}.ext",
            "-out", f"{name}.crt", cwd=pki)  # fmt: skip
    (pki / f"{name}.key").chmod(0o600)


def make_certificates(pki: Path) -> None:
    """CA, serving certs (API server, webhook), client certs (admin, scheduler), SA key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    openssl(
        "req", "-x509", *EC_KEY, "-keyout", "ca.key", "-out", "ca.crt", "-days", "7",
        "-subj", "/CN=tessera-e2e-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    sign_leaf(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        "serverAuth",
        "IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
    )
    sign_leaf(pki, "webhook", "/CN=tessera-webhook", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    sign_leaf(pki, "admin", "/O=system:masters/CN=tessera-e2e-admin", "clientAuth")
    sign_leaf(pki, "scheduler", "/CN=system:kube-scheduler", "clientAuth")
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", "sa.key", cwd=pki)  # fmt: skip
    openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A kubeconfig for `server` as `user`, with the client certificate `<user>.crt` of `pki`."""
    # JSON is YAML: every Kubernetes client reads it.
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "tessera-e2e",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate": str(pki / f"{user}.crt"),
                    "client-key": str(pki / f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": "tessera-e2e", "context": {"cluster": "tessera-e2e", "user": user}}],
        "current-context": "tessera-e2e",
    }
    path.write_text(json.dumps(config, indent=2))
