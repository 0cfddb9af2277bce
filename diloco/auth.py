"""Credentials: the coordinator signs a learner id with the run's secret; shards verify it
with the same secret, so they need no call to the coordinator per push.

Each purpose signs its own domain (``diloco-learner-v2:<id>:<expiry>`` for process
credentials, ``diloco-join-v2:<name>:<limit>:<tokens/s>`` for join credentials), so no
token of one kind is ever valid as another: a join credential is not the credential of
any id.

A join credential (``JoinCredential``) names itself, carries how many learners it may
have in the run at once and how many tokens per second each of them is credited at most,
all signed: whoever holds one can neither raise its limit nor pass as another.

A credential expires (``<expiry unix s>.<mac>``; the coordinator issues them for
``--credential-lifetime-s``, 900 s by default) and a learner's is renewed by every
heartbeat reply, so one that leaks from a learner that is gone, or from a log, stops
working; while it lasts, shards and the coordinator also refuse ids their membership does
not list."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import time
from dataclasses import dataclass

from diloco.errors import InvalidArgument, Unauthenticated

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
# A join credential is the run secret's signature of its fields in this domain: a launcher
# can hand it to a new learner without handing it the secret itself.
_JOIN_DOMAIN = "diloco-join-v2:"
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


UNCOUNTED = "any"
"""A join credential's tokens/s field for learners whose claims are credited as they are
(the credentials the coordinator mints for the learners it launches itself)."""
JOIN_NAME = re.compile(r"^[a-z0-9][-a-z0-9]{0,39}$")
MAX_JOIN_LIMIT = 2048
"""The most learners one join credential may admit (the coordinator's own cap)."""


@dataclass(frozen=True)
class JoinCredential:
    """What a learner presents (metadata x-diloco-join-token) to be allowed to Join:
    ``<name>.<limit>.<tokens/s>.<mac>``."""

    name: str
    """Its name: what the coordinator counts admissions by and error messages say."""
    limit: int
    """How many learners it admits at once (live members)."""
    tokens_per_s: float | None
    """The most tokens per second credited to each learner it admits; None: as claimed."""

    def __post_init__(self) -> None:
        if not JOIN_NAME.match(self.name):
            raise InvalidArgument(f"a join credential's name is 1-40 lowercase letters, digits and '-', got {self.name!r}")
        if not 1 <= self.limit <= MAX_JOIN_LIMIT:
            raise InvalidArgument(f"a join credential admits 1 to {MAX_JOIN_LIMIT} learners, got {self.limit}")
        if self.tokens_per_s is not None and not (math.isfinite(self.tokens_per_s) and self.tokens_per_s >= 0):
            raise InvalidArgument(f"tokens per second must be a finite number >= 0, got {self.tokens_per_s}")

    def _body(self) -> str:
        rate = UNCOUNTED if self.tokens_per_s is None else f"{int(self.tokens_per_s)}"
        return f"{self.name}.{self.limit}.{rate}"

    def mint(self, secret: str) -> str:
        body = self._body()
        return f"{body}.{_mac(secret, _JOIN_DOMAIN + body.replace('.', ':'))}"


def join_credential(secret: str, name: str, limit: int, tokens_per_s: float | None = None) -> str:
    """A join credential for ``limit`` learners at once, each credited at most
    ``tokens_per_s`` (None: as claimed)."""
    return JoinCredential(name, limit, None if tokens_per_s is None else float(int(tokens_per_s))).mint(secret)


def check_join(secret: str, presented: str | None) -> JoinCredential:
    """The join credential presented, checked against the run secret."""
    if not presented:
        raise Unauthenticated("missing join credential (metadata x-diloco-join-token)")
    parts = presented.split(".")
    if len(parts) != 4:
        raise Unauthenticated("not a join credential (NAME.LIMIT.TOKENS_PER_S.MAC; a join token of the older "
                              "single-MAC kind is no longer accepted: mint one with `diloco admin join-credential`)")
    name, limit, rate, mac = parts
    if not hmac.compare_digest(_mac(secret, _JOIN_DOMAIN + f"{name}:{limit}:{rate}"), mac):
        raise Unauthenticated(f"invalid join credential {name[:40]!r}")
    # Signed by the run secret, so well formed: the checks below only guard the parse.
    if not (limit.isdigit() and (rate == UNCOUNTED or rate.isdigit())):
        raise Unauthenticated(f"invalid join credential {name[:40]!r}")
    try:
        return JoinCredential(name, int(limit), None if rate == UNCOUNTED else float(rate))
    except InvalidArgument as error:
        raise Unauthenticated(f"invalid join credential: {error}") from None


def manifest_mac(secret: str, manifest: dict) -> str:
    """The run's authentication of a snapshot manifest (every field but ``mac``, in
    canonical JSON): whoever can write the snapshot directory cannot forge one."""
    body = json.dumps({k: v for k, v in manifest.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return _mac(secret, _SNAPSHOT_DOMAIN + body)
