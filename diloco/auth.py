"""Credentials: the coordinator signs a learner id with the run's secret; shards verify it
with the same secret, so they need no call to the coordinator per push.

Each purpose signs its own domain (``diloco-learner-v2:<id>:<expiry>`` for process
credentials, ``diloco-join-v1`` for the join token), so no token of one kind is ever valid
as another: the join token every launcher holds is not the credential of any id.

A credential expires (``<expiry unix s>.<mac>``; the coordinator issues them for
``--credential-lifetime-s``, 900 s by default) and a learner's is renewed by every
heartbeat reply, so one that leaks from a learner that is gone, or from a log, stops
working; while it lasts, shards and the coordinator also refuse ids their membership does
not list."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time

from diloco.errors import Unauthenticated

LEARNER_METADATA = "x-diloco-learner"
CREDENTIAL_METADATA = "x-diloco-credential"
ADMIN_METADATA = "x-diloco-admin-token"
JOIN_METADATA = "x-diloco-join-token"
# The coordinator's id (and vector clock process name); it signs it like a learner id
# when it calls the shards (snapshot markers).
COORDINATOR_ID = "C"
# The run's validator (``diloco validator``): signed from the run secret like the shards,
# the only caller of a shard's Samples and Score.
VALIDATOR_ID = "V"
# The join token is the run secret's signature of this string: a launcher can hand it to
# a new learner without handing it the secret itself. Operators make it with
# `printf %s diloco-join-v1 | openssl dgst -sha256 -hmac "$SECRET"`.
_JOIN_DOMAIN = "diloco-join-v1"
_CREDENTIAL_DOMAIN = "diloco-learner-v2:"
CREDENTIAL_LIFETIME_S = 900.0
"""How long a credential is valid: three times a learner's default coordinator-loss
timeout (300 s), so a learner whose coordinator is away stops on its own first."""
_SNAPSHOT_DOMAIN = "diloco-snapshot-v1:"


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: str, message: str) -> str:
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def sign(secret: str, learner_id: str, lifetime_s: float = CREDENTIAL_LIFETIME_S, now: float | None = None) -> str:
    """The credential of a process id (learners ``L<n>``, shards ``S<m>``, the coordinator),
    valid for ``lifetime_s`` from ``now``."""
    expires = int((time.time() if now is None else now) + lifetime_s)
    return f"{expires}.{_mac(secret, f'{_CREDENTIAL_DOMAIN}{learner_id}:{expires}')}"


def expiry(credential: str) -> int | None:
    """When a well-formed credential expires (unix s); None for anything else."""
    expires, dot, _ = credential.partition(".")
    return int(expires) if dot and expires.isascii() and expires.isdigit() and len(expires) <= 12 else None


def verify(secret: str, learner_id: str, credential: str | None, now: float | None = None) -> None:
    if not learner_id:
        raise Unauthenticated("missing learner id (metadata x-diloco-learner)")
    if not credential:
        raise Unauthenticated(f"missing credential for learner {learner_id!r} (metadata x-diloco-credential)")
    expires = expiry(credential)
    expected = _mac(secret, f"{_CREDENTIAL_DOMAIN}{learner_id}:{expires}") if expires is not None else ""
    if expires is None or not hmac.compare_digest(expected, credential.partition(".")[2]):
        raise Unauthenticated(f"invalid credential for learner {learner_id!r}")
    late = (time.time() if now is None else now) - expires
    if late >= 0:
        raise Unauthenticated(f"the credential of {learner_id!r} expired {late:.0f} s ago "
                              "(a learner's is renewed by every heartbeat reply)")


class Credential:
    """A process's id and its current credential, which every channel of the process reads
    per call: a learner's is renewed in place from heartbeat replies (``renew``); one made
    from the run secret (shards, the coordinator, static learners, the command line) signs itself
    again when half its lifetime is gone."""

    def __init__(self, learner_id: str, value: str = "", secret: str | None = None,
                 lifetime_s: float = CREDENTIAL_LIFETIME_S) -> None:
        self.id, self._secret, self._lifetime_s = learner_id, secret, lifetime_s
        self._value = value or (sign(secret, learner_id, lifetime_s) if secret is not None else "")

    @property
    def value(self) -> str:
        if self._secret is not None and (expiry(self._value) or 0) - time.time() < self._lifetime_s / 2:
            self._value = sign(self._secret, self.id, self._lifetime_s)
        return self._value

    def renew(self, value: str) -> None:
        """Take a newer credential (a heartbeat reply's); an empty one changes nothing."""
        if value:
            self._value = value

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((LEARNER_METADATA, self.id), (CREDENTIAL_METADATA, self.value))


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
