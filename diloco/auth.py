"""Credentials: the coordinator signs a learner id with the run's secret; shards verify it
with the same secret, so they need no call to the coordinator per push.

Each purpose signs its own domain (``diloco-learner-v1:<id>`` for process credentials,
``diloco-join-v1`` for the join token), so no token of one kind is ever valid as another:
the join token every launcher holds is not the credential of any id."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from diloco.errors import Unauthenticated

LEARNER_METADATA = "x-diloco-learner"
CREDENTIAL_METADATA = "x-diloco-credential"
ADMIN_METADATA = "x-diloco-admin-token"
JOIN_METADATA = "x-diloco-join-token"
# The coordinator's id (and vector clock process name); it signs it like a learner id
# when it calls the shards (snapshot markers).
COORDINATOR_ID = "C"
# The join token is the run secret's signature of this string: a launcher can hand it to
# a new learner without handing it the secret itself. Operators make it with
# `printf %s diloco-join-v1 | openssl dgst -sha256 -hmac "$SECRET"`.
_JOIN_DOMAIN = "diloco-join-v1"
_CREDENTIAL_DOMAIN = "diloco-learner-v1:"
_SNAPSHOT_DOMAIN = "diloco-snapshot-v1:"


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: str, message: str) -> str:
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def sign(secret: str, learner_id: str) -> str:
    """The credential of a process id (learners ``L<n>``, shards ``S<m>``, the coordinator)."""
    return _mac(secret, _CREDENTIAL_DOMAIN + learner_id)


def verify(secret: str, learner_id: str, credential: str | None) -> None:
    if not learner_id:
        raise Unauthenticated("missing learner id (metadata x-diloco-learner)")
    if not credential:
        raise Unauthenticated(f"missing credential for learner {learner_id!r} (metadata x-diloco-credential)")
    if not hmac.compare_digest(sign(secret, learner_id), credential):
        raise Unauthenticated(f"invalid credential for learner {learner_id!r}")


def check_admin(token: str, presented: str | None) -> None:
    if not presented:
        raise Unauthenticated("missing admin token (metadata x-diloco-admin-token)")
    if not hmac.compare_digest(token, presented):
        raise Unauthenticated("invalid admin token")


def join_token(secret: str) -> str:
    """What a learner presents (metadata x-diloco-join-token) to be allowed to Join."""
    return _mac(secret, _JOIN_DOMAIN)


def check_join(secret: str, presented: str | None) -> None:
    if not presented:
        raise Unauthenticated("missing join token (metadata x-diloco-join-token)")
    if not hmac.compare_digest(join_token(secret), presented):
        raise Unauthenticated("invalid join token")


def manifest_mac(secret: str, manifest: dict) -> str:
    """The run's authentication of a snapshot manifest (every field but ``mac``, in
    canonical JSON): whoever can write the snapshot directory cannot forge one."""
    body = json.dumps({k: v for k, v in manifest.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return _mac(secret, _SNAPSHOT_DOMAIN + body)
