"""Credentials: the coordinator signs a learner id with the run's secret; shards verify it
with the same secret, so they need no call to the coordinator per push."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from diloco.errors import Unauthenticated

LEARNER_METADATA = "x-diloco-learner"
CREDENTIAL_METADATA = "x-diloco-credential"
ADMIN_METADATA = "x-diloco-admin-token"


def new_secret() -> str:
    return secrets.token_hex(32)


def sign(secret: str, learner_id: str) -> str:
    return hmac.new(secret.encode(), learner_id.encode(), hashlib.sha256).hexdigest()


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
