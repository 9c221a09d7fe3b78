"""Who may call what. A caller proves who it is with a bearer token in the call metadata
(`authorization: Bearer ...`) or a client certificate (mutual TLS); each maps to a role,
`read` or `admin`. One table names what every served method needs, and one interceptor
applies it: unknown credentials are UNAUTHENTICATED, a `read` caller on a mutation is
PERMISSION_DENIED, and neither reaches a servicer. Tokens are compared in constant time and
never logged; the set can be replaced while serving (SIGHUP re-reads the file).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


class Role(enum.Enum):
    READ = "read"  # generation, info, state, watch, checksum
    ADMIN = "admin"  # everything, every mutation included

    def allows(self, needed: Role) -> bool:
        return self is Role.ADMIN or needed is Role.READ


class Listener(enum.Enum):
    """What one listening address serves, when inference and control are split."""

    ALL = "all"
    INFERENCE = "inference"  # generation and the read-only server information
    CONTROL = "control"  # the control plane (and its reads)


PUBLIC = "public"  # health and reflection: reachable without credentials, on every listener
PUBLIC_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
)

# Every method of every served service, with what it needs. A method missing here is
# refused (a test walks every served method and checks it has a rule).
RULES: dict[str, Role] = {
    "/vllm.Inference/Generate": Role.READ,
    "/vllm.Inference/GenerateStream": Role.READ,
    "/vllm.Control/GetServerInfo": Role.READ,
    "/vllm.Control/GetModelInfo": Role.READ,
    "/vllm.Control/GetKvEventSources": Role.READ,
    "/vllm.Control/LoadLora": Role.ADMIN,
    "/vllm.Control/UnloadLora": Role.ADMIN,
    "/vllm.Control/ListLoras": Role.READ,
    "/vllm.Control/IsPaused": Role.READ,
    "/vllm.Control/IsSleeping": Role.READ,
    "/vllm.Control/GetWeightVersion": Role.READ,
    "/vllm.Control/Shutdown": Role.ADMIN,
    "/vllm.Control/Abort": Role.ADMIN,
    "/vllm.Control/PauseGeneration": Role.ADMIN,
    "/vllm.Control/ResumeGeneration": Role.ADMIN,
    "/vllm.Control/Sleep": Role.ADMIN,
    "/vllm.Control/WakeUp": Role.ADMIN,
    "/vllm.Control/InitWeightTransferEngine": Role.ADMIN,
    "/vllm.Control/StartWeightUpdate": Role.ADMIN,
    "/vllm.Control/StartDraftWeightUpdate": Role.ADMIN,
    "/vllm.Control/UpdateWeights": Role.ADMIN,
    "/vllm.Control/FinishWeightUpdate": Role.ADMIN,
    "/vllm.Control/UpdateWeightVersion": Role.ADMIN,
    "/rlserve.v1.Lifecycle/GetState": Role.READ,
    "/rlserve.v1.Lifecycle/WatchState": Role.READ,
    "/rlserve.v1.Lifecycle/GetWeightChecksum": Role.READ,
    "/rlserve.v1.Lifecycle/GetLoad": Role.READ,
    "/rlserve.v1.Lifecycle/StartLoraUpdate": Role.ADMIN,
    "/rlserve.v1.Lifecycle/FinishLoraUpdate": Role.ADMIN,
    "/rlserve.v1.Lifecycle/UpdateWeightVersion": Role.ADMIN,
    "/rlserve.v1.Lifecycle/AbortWeightUpdate": Role.ADMIN,
    "/rlserve.v1.Lifecycle/PrepareWeightUpdate": Role.ADMIN,
    "/rlserve.v1.Lifecycle/StageWeightUpdate": Role.ADMIN,
}
# Read-only server information routers ask the inference address for (vllm-router does).
INFERENCE_CONTROL_READS = (
    "/vllm.Control/GetServerInfo",
    "/vllm.Control/GetModelInfo",
    "/vllm.Control/GetKvEventSources",
    "/vllm.Control/ListLoras",
)


# Older and proposed service names (api/vllm/aliases.proto): each method is its canonical
# method, for authorization and for where it is served.
ALIASES = {"vllm.Generate": "vllm.Inference", "vllm.RlControl": "vllm.Control"}


def canonical(method: str) -> str:
    service, _, name = method.strip("/").partition("/")
    return f"/{ALIASES.get(service, service)}/{name}"


def rule_for(method: str) -> Role | str | None:
    """The role `method` needs, PUBLIC, or None when no rule exists (refused)."""
    service = method.strip("/").partition("/")[0]
    if service in PUBLIC_SERVICES:
        return PUBLIC
    return RULES.get(canonical(method))


def served_here(method: str, listener: Listener) -> bool:
    if listener is Listener.ALL or rule_for(method) == PUBLIC:
        return True
    method = canonical(method)
    if listener is Listener.INFERENCE:
        return method.startswith("/vllm.Inference/") or method in INFERENCE_CONTROL_READS
    return not method.startswith("/vllm.Inference/")


@dataclass(frozen=True)
class Grant:
    role: Role
    name: str


class Credentials:
    """Parsed from lines `ROLE TOKEN [NAME]` or `ROLE cert:COMMON_NAME [NAME]` (ROLE `read`
    or `admin`, `#` starts a comment). Several tokens may map to one role, so a token can be
    rotated without a restart."""

    def __init__(self, tokens: Iterable[tuple[bytes, Grant]], subjects: dict[str, Grant]) -> None:
        self._tokens = tuple(tokens)
        self._subjects = dict(subjects)

    @property
    def is_empty(self) -> bool:
        return not self._tokens and not self._subjects

    @classmethod
    def parse(cls, text: str) -> Credentials:
        """Raises ValueError naming the line (never quoting a token)."""
        tokens: list[tuple[bytes, Grant]] = []
        subjects: dict[str, Grant] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) not in (2, 3):
                raise ValueError(f"auth tokens line {number}: expected 'ROLE TOKEN [NAME]'")
            try:
                role = Role(parts[0])
            except ValueError:
                raise ValueError(f"auth tokens line {number}: role must be 'read' or 'admin'") from None
            secret = parts[1]
            if secret.startswith("cert:"):
                subject = secret.removeprefix("cert:")
                subjects[subject] = Grant(role, parts[2] if len(parts) == 3 else subject)
                continue
            if len(secret) < MIN_TOKEN_CHARS:
                raise ValueError(f"auth tokens line {number}: a token needs at least {MIN_TOKEN_CHARS} characters")
            name = parts[2] if len(parts) == 3 else f"token-{_fingerprint(secret)}"
            tokens.append((secret.encode(), Grant(role, name)))
        return cls(tokens, subjects)

    def for_token(self, token: str) -> Grant | None:
        """Compares with every token, in constant time each, whatever matches."""
        given = token.encode()
        found = None
        for secret, grant in self._tokens:
            if hmac.compare_digest(secret, given):
                found = grant
        return found

    def for_certificate(self, subject: CertificateSubject) -> Grant | None:
        """A common name listed as `cert:NAME`, or a certificate whose subject carries the role
        itself as an organizational unit `rlserve-admin` / `rlserve-read` (the CA vouches). A
        subject carrying both gets the lesser role: a CA that signed both vouched for read."""
        if subject.common_name in self._subjects:
            return self._subjects[subject.common_name]
        units = set(subject.organizational_units)
        for role in (Role.READ, Role.ADMIN):
            if f"rlserve-{role.value}" in units:
                return Grant(role, printable(subject.common_name) or "certificate")
        return None


@dataclass(frozen=True)
class CertificateSubject:
    """A client certificate's subject, read attribute by attribute from the certificate itself
    (never from a printed subject string, where a ',' inside a value looks like a separator)."""

    common_name: str
    organizational_units: tuple[str, ...]

    @classmethod
    def from_pem(cls, pem: bytes) -> CertificateSubject:
        """Raises ValueError for a certificate that does not parse or names no single CN."""
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        subject = x509.load_pem_x509_certificate(pem).subject
        names = [str(a.value) for a in subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        if len(names) != 1:
            raise ValueError(f"the client certificate's subject has {len(names)} common names: it needs one")
        units = tuple(str(a.value) for a in subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME))
        return cls(names[0], units)


# Longest identity kept for logs and the audit: a common name may be 64 characters, a
# token's name whatever the file says.
IDENTITY_CHARS = 128


def printable(name: str) -> str:
    """`name` as it may appear in a log line: every character outside printable ASCII, and the
    backslash, escaped (a newline in a certificate's CN cannot start a forged line)."""
    escaped = "".join(c if " " <= c <= "~" and c != "\\" else c.encode("unicode_escape").decode() for c in name)
    return escaped[:IDENTITY_CHARS]


def _fingerprint(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:8]


class CredentialSource:
    """The current credentials, loaded from `read()` (a file, or the environment's text) and
    reloaded on request; a reload that fails keeps the credentials that were in force.
    `text` is what the credentials in force were parsed from (what frontend 0 hands the
    other frontend processes)."""

    def __init__(self, read: Callable[[], str], description: str) -> None:
        self._read = read
        self.description = description
        self.text = read()
        self.current = Credentials.parse(self.text)

    def reload(self) -> bool:
        try:
            text = self._read()
            self.current, self.text = Credentials.parse(text), text
        except (OSError, ValueError) as e:
            logger.error("kept the old auth tokens: reloading %s failed: %s", self.description, e)
            return False
        logger.info("reloaded auth tokens from %s", self.description)
        return True

    def replace(self, text: str) -> None:
        """Take these credentials (frontend 0's, already parsed there). Raises ValueError."""
        self.current, self.text = Credentials.parse(text), text
