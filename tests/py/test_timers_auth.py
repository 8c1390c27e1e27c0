"""Who may call the timer routes (QUEEN_AUTH=jwt): 401 unauthorized, 403 forbidden,
producerSub from the JWT sub, the tenant from the JWT tenant."""

from __future__ import annotations

import base64
import hmac
import json
import time

import jwt
import pytest

from timers_util import JWT_SECRET, assert_error, op, post, rows, token


def calls(c, headers):
    return {
        "POST": post(c, op("schedule", "k"), headers=headers),
        "DELETE": c.delete("/api/v1/timers/reminders/k", headers=headers),
        "PEEK": c.get("/api/v1/timers/reminders/k", headers=headers),
        "LIST": c.get("/api/v1/timers/reminders", headers=headers),
    }


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer not-a-jwt"},
    token("admin", secret="another-secret-of-at-least-32-bytes-long!"),
    token("admin", exp=1),  # expired
    token("superuser"),  # unknown role
])
def test_no_or_bad_credential_is_401(jwt_client, db, headers):
    for name, r in calls(jwt_client, headers).items():
        assert r.status_code == 401, (name, r.text)
        assert r.json()["error"] == "unauthorized"
    assert rows(db) == []


def test_two_authorization_headers_are_401_whichever_is_valid(jwt_client, db):
    """A proxy in front may have checked another copy than the broker would read:
    two Authorization headers, both valid, are refused on every route, before anything."""
    twice = [("Authorization", token("admin", tenant="acme")["Authorization"]),
             ("Authorization", token("admin", tenant="globex")["Authorization"])]
    for name, r in {**calls(jwt_client, twice),
                    "POP": jwt_client.get("/api/v1/pop/queue/reminders", headers=twice),
                    "PUSH": jwt_client.post("/api/v1/push", headers=twice, json={"items": [
                        {"queue": "reminders", "payload": {"a": 1}}]})}.items():
        body = assert_error(r, 401, "unauthorized")
        assert "2 Authorization headers" in body["detail"], (name, body)
    assert rows(db) == []
    assert db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == 0
    assert post(jwt_client, op("schedule", "k"), headers=token("admin")).status_code == 200


@pytest.mark.parametrize("role, allowed", [
    ("read-only", {"PEEK", "LIST"}),
    ("write-only", {"POST"}),
    ("read-write", {"POST", "DELETE", "PEEK", "LIST"}),
    ("admin", {"POST", "DELETE", "PEEK", "LIST"}),
])
def test_access_levels(jwt_client, db, role, allowed):
    for name, r in calls(jwt_client, token(role)).items():
        if name in allowed:
            assert r.status_code == 200, (role, name, r.text)
        else:
            assert_error(r, 403, "forbidden")
            assert "x-queen-timers-hint" not in r.headers


def test_producer_sub_and_tenant_come_from_the_token(jwt_client, db):
    r = post(jwt_client, op("schedule", "k"), headers=token("write-only", sub="billing-service"))
    assert r.json()["results"][0]["status"] == "scheduled"
    [row] = rows(db)
    assert (row["tenant"], row["producer_sub"]) == ("acme", "billing-service")
    peek = jwt_client.get("/api/v1/timers/reminders/k", headers=token("read-only", sub="someone-else"))
    assert peek.json()["producerSub"] == "billing-service"


def test_another_tenants_timer_is_absent_and_invisible(jwt_client, db):
    post(jwt_client, op("schedule", "k"), headers=token("write-only", tenant="acme"))
    other = token("read-write", tenant="globex")
    assert jwt_client.get("/api/v1/timers/reminders/k", headers=other).json() == {"found": False}
    assert jwt_client.get("/api/v1/timers/reminders", headers=other).json()["rows"] == []
    d = jwt_client.delete("/api/v1/timers/reminders/k", headers=other)
    assert d.json()["status"] == "absent" and d.json()["ok"] is False
    assert post(jwt_client, op("cancel", "k"), headers=token("write-only", tenant="globex")
                ).json()["results"][0]["status"] == "absent"
    # globex scheduling the same key makes a second, separate timer
    post(jwt_client, op("schedule", "k"), headers=token("write-only", tenant="globex"))
    assert [r["tenant"] for r in rows(db)] == ["acme", "globex"]
    assert jwt_client.delete("/api/v1/timers/reminders/k", headers=token("read-write", tenant="acme")
                             ).json()["status"] == "cancelled"
    assert [r["tenant"] for r in rows(db)] == ["globex"]


def test_auth_is_checked_before_shape(jwt_client, db):
    r = jwt_client.post("/api/v1/timers", content=b"{not json")
    assert_error(r, 401, "unauthorized")


def test_openapi_and_health_are_public(jwt_client, db):
    assert jwt_client.get("/openapi.json").status_code == 200
    assert jwt_client.get("/health").status_code == 200


# ---------------------------------------------------------------------------
# Malformed claims and headers: every one a JSON 401, nothing written, and
# the broker answers the next good call.
# ---------------------------------------------------------------------------

def raw_token(secret: str = JWT_SECRET, **claims) -> str:
    """A signed HS256 token with exactly these claims (`...` drops a default)."""
    body = {"sub": "billing-service", "tenant": "acme", "role": "admin", "exp": int(time.time()) + 600}
    body.update(claims)
    return jwt.encode({k: v for k, v in body.items() if v is not ...}, secret, algorithm="HS256")


def bearer(**claims) -> dict:
    return {"Authorization": f"Bearer {raw_token(**claims)}"}


def assert_refused_401(c, db, headers, detail_part: str) -> None:
    for name, r in calls(c, headers).items():
        assert r.status_code == 401, (name, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json"), (name, r.headers)
        body = r.json()
        assert body["error"] == "unauthorized", (name, body)
        assert detail_part in body["detail"], (name, body)
    assert rows(db) == []
    # the broker is healthy: a good credential still works
    ok = post(c, op("schedule", "after-refusal"), headers=token("admin"))
    assert ok.status_code == 200, ok.text
    assert [r["timer_key"] for r in rows(db)] == ["after-refusal"]
    db.execute("DELETE FROM queen.timers")


@pytest.mark.parametrize("role", [["admin"], {"a": 1}, 7, True, None, ""])
def test_a_role_that_is_not_a_string_or_empty_is_401(jwt_client, db, role):
    assert_refused_401(jwt_client, db, bearer(role=role), "role claim")


def test_a_missing_role_is_401(jwt_client, db):
    assert_refused_401(jwt_client, db, bearer(role=...), "role claim")


@pytest.mark.parametrize("tenant", [..., "", None, ["acme"], {"t": "acme"}, 42])
def test_a_missing_empty_or_non_string_tenant_is_401_never_tenant_default(jwt_client, db, tenant):
    assert_refused_401(jwt_client, db, bearer(tenant=tenant), "tenant claim")


@pytest.mark.parametrize("sub", [..., "", ["x"], {"s": 1}, 42])
def test_a_missing_empty_or_non_string_sub_is_401(jwt_client, db, sub):
    # PyJWT itself refuses a missing or non-string sub; either way a JSON 401
    assert_refused_401(jwt_client, db, bearer(sub=sub), "")


@pytest.mark.parametrize("claim", ["tenant", "sub"])
@pytest.mark.parametrize("value", ["acme\x00evil", "\ud800"])
def test_a_claim_postgresql_text_cannot_hold_is_401(jwt_client, db, claim, value):
    """A NUL would end the text libpq sends ("acme\0evil" acting as tenant acme, or a
    forged producerSub); a lone surrogate is not UTF-8. A signed token is no reason to
    let either reach the database: 401 on every route, before anything runs."""
    post(jwt_client, op("schedule", "k"), headers=token("write-only", tenant="acme"))
    headers = token("admin", **{claim: value})
    answers = {**calls(jwt_client, headers),  # POST schedules k, DELETE cancels it
               "POP": jwt_client.get("/api/v1/pop/queue/reminders", headers=headers),
               "PUSH": jwt_client.post("/api/v1/push", headers=headers,
                                       json={"items": [{"queue": "reminders", "payload": {"a": 1}}]})}
    for name, r in answers.items():
        body = assert_error(r, 401, "unauthorized")
        assert f"{claim} claim" in body["detail"], (name, body)
    # acme's timer is untouched: still there, still acme's and its producer's
    assert [(r["tenant"], r["timer_key"], r["producer_sub"]) for r in rows(db)] == [
        ("acme", "k", "billing-service")]
    assert db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == 0


def test_a_token_without_exp_is_401(jwt_client, db):
    assert_refused_401(jwt_client, db, bearer(exp=...), "exp")


@pytest.mark.parametrize("exp", ["tomorrow", [1], {"t": 1}])
def test_a_non_numeric_exp_is_401(jwt_client, db, exp):
    assert_refused_401(jwt_client, db, bearer(exp=exp), "exp")


def test_an_expired_token_is_401_past_the_leeway(jwt_client, db):
    assert_refused_401(jwt_client, db, bearer(exp=int(time.time()) - 60), "expired")


def test_exp_leeway_is_configurable(broker_factory, db):
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET, QUEEN_JWT_LEEWAY_SECONDS="300")
    with b.client() as c:
        # expired a minute ago: within 300 s of leeway
        r = post(c, op("schedule", "late"), headers=bearer(exp=int(time.time()) - 60))
        assert r.status_code == 200, r.text
        r = post(c, op("schedule", "too-late"), headers=bearer(exp=int(time.time()) - 900))
        assert_error(r, 401, "unauthorized")
    assert [r["timer_key"] for r in rows(db)] == ["late"]


@pytest.mark.parametrize("make_header", [
    lambda: raw_token(),                       # no scheme at all
    lambda: f"Basic {raw_token()}",            # another scheme
    lambda: f"Token {raw_token()}",
    lambda: "Bearer",                           # the scheme and no token
    lambda: f"Bearer{raw_token()}",            # no space
])
def test_the_header_must_be_bearer_token(jwt_client, db, make_header):
    assert_refused_401(jwt_client, db, {"Authorization": make_header()}, "")


def test_bearer_scheme_is_case_insensitive(jwt_client, db):
    r = post(jwt_client, op("schedule", "k"), headers={"Authorization": f"bearer {raw_token()}"})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------
# What checking a credential may cost (it happens before the tenant's turn):
# QUEEN_JWT_MAX_BYTES, the HS256 filter in front of PyJWT, the tokens already
# accepted. A legal token is served whatever its size within the limit.
# ---------------------------------------------------------------------------

def test_a_token_past_the_limit_is_401_and_a_legal_one_within_it_is_served(broker_factory, db):
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET, QUEEN_JWT_MAX_BYTES="2048")
    within = raw_token(pad="p" * 1300)
    past = raw_token(pad="p" * 1400)
    assert len(within) <= 2048 < len(past)
    with b.client() as c:
        assert_refused_401(c, db, {"Authorization": f"Bearer {past}"}, "longer than 2048 bytes (QUEEN_JWT_MAX_BYTES)")
        r = post(c, op("schedule", "big-token"), headers={"Authorization": f"Bearer {within}"})
        assert r.status_code == 200, r.text
    assert [r["timer_key"] for r in rows(db)] == ["big-token"]  # assert_refused_401 cleared its own


def test_the_default_limit_serves_a_token_of_7_kb(jwt_client, db):
    big = raw_token(pad="p" * 5300)
    assert 7000 < len(big) <= 8192
    r = post(jwt_client, op("schedule", "k"), headers={"Authorization": f"Bearer {big}"})
    assert r.status_code == 200, r.text
    assert jwt_client.delete("/api/v1/timers/reminders/k", headers={"Authorization": f"Bearer {big}"}
                             ).json()["status"] == "cancelled"


@pytest.mark.parametrize("value", ["a.b", "a.b.c.d", "a" * 300])
def test_a_token_not_of_three_segments_is_401(jwt_client, db, value):
    assert_refused_401(jwt_client, db, {"Authorization": f"Bearer {value}"}, "three segments")


def pem_of(private_key) -> str:
    """The public half of `private_key`, as QUEEN_JWT_PUBLIC_KEY takes it."""
    from cryptography.hazmat.primitives import serialization
    return private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def hs256_under(secret: str, claims: dict) -> str:
    """An HS256 token with `secret` as its key, built by hand: PyJWT refuses to sign with a
    PEM (the algorithm confusion: HS256 with a public key's PEM as the secret)."""
    signing_input = ".".join(base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()
                             for part in ({"alg": "HS256", "typ": "JWT"}, claims))
    return signing_input + "." + base64.urlsafe_b64encode(
        hmac.digest(secret.encode(), signing_input.encode(), "sha256")).rstrip(b"=").decode()


def counting_authenticator(monkeypatch, **settings):
    """An Authenticator of QUEEN_AUTH=jwt with `settings`, `check(token)` giving what it
    finds for a Bearer token, and the list jwt.decode appends to at each call."""
    from queen_timers import auth
    from queen_timers.config import Settings
    a = auth.Authenticator(Settings(database_url="postgresql://127.0.0.1:1/none", auth="jwt", **settings))
    decoded = []
    real = auth.jwt.decode
    monkeypatch.setattr(auth.jwt, "decode", lambda *args, **kw: decoded.append(1) or real(*args, **kw))

    def check(token):
        return a.identify({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})
    return a, check, decoded


def test_a_token_the_secret_did_not_sign_never_reaches_pyjwt(monkeypatch):
    """The HS256 filter: PyJWT checks every character of a token in Python (0.5 ms for
    13 KB), so a token whose MAC is wrong is refused before it; a good one is then checked
    by PyJWT in full, once: the next request with it is served from the accepted tokens."""
    from queen_timers import auth
    _, check, decoded = counting_authenticator(monkeypatch, jwt_secret=JWT_SECRET)
    forged = raw_token(secret="another-secret-of-at-least-32-bytes-long!", pad="p" * 5500)
    for bad in (forged, forged[:-2] + "==", forged.rpartition(".")[0] + "." + "A" * 80,
                forged.rpartition(".")[0] + ".\u00e9\u00e9"):
        found = check(bad)
        assert isinstance(found, auth.ApiError) and found.status == 401, found
        assert "Signature verification failed" in found.detail, found.detail
    assert decoded == []
    good = raw_token(tenant="globex", role="read-only")
    for _ in range(3):
        assert check(good) == auth.Principal(tenant="globex", sub="billing-service", role="read-only")
    assert decoded == [1]
    # the same token with its signature in another (padded) spelling is checked by PyJWT
    assert check(good + "=").tenant == "globex" and decoded == [1, 1]


def test_an_accepted_token_is_refused_once_it_expires(broker_factory, db):
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET, QUEEN_JWT_LEEWAY_SECONDS="0")
    exp = int(time.time()) + 2
    headers = bearer(exp=exp)
    with b.client() as c:
        assert post(c, op("schedule", "k1"), headers=headers).status_code == 200
        time.sleep(max(0.0, exp - time.time()) + 0.2)
        r = post(c, op("schedule", "k2"), headers=headers)
        assert "expired" in assert_error(r, 401, "unauthorized")["detail"]
        assert post(c, op("schedule", "k3"), headers=bearer()).status_code == 200
    assert sorted(r["timer_key"] for r in rows(db)) == ["k1", "k3"]


def test_a_public_key_verifies_its_tokens_and_no_other(broker_factory, db):
    """QUEEN_JWT_PUBLIC_KEY: an Ed25519 key accepts EdDSA tokens signed by its private
    half; a token of another key, or HS256 under any secret, is a 401."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pem = pem_of(key)
    claims = {"sub": "billing-service", "tenant": "acme", "role": "admin", "exp": int(time.time()) + 600}
    confused = hs256_under(pem, claims)  # the algorithm confusion
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_PUBLIC_KEY=pem)
    with b.client() as c:
        for bad in (jwt.encode(claims, other, algorithm="EdDSA"), jwt.encode(claims, JWT_SECRET, algorithm="HS256"),
                    confused):
            assert_error(post(c, op("schedule", "no"), headers={"Authorization": f"Bearer {bad}"}),
                         401, "unauthorized")
        good = {"Authorization": f"Bearer {jwt.encode(claims, key, algorithm='EdDSA')}"}
        for _ in range(2):
            assert post(c, op("schedule", "yes"), headers=good).status_code == 200
    assert [r["timer_key"] for r in rows(db)] == ["yes"]


def test_the_limit_is_configurable_within_the_request_heads():
    from queen_timers.config import ConfigError, Settings
    base = {"QUEEN_DATABASE_URL": "postgresql://x/y"}
    assert Settings.from_env(base).jwt_max_bytes == 8192
    assert Settings.from_env({**base, "QUEEN_JWT_MAX_BYTES": "16384"}).jwt_max_bytes == 16384
    for bad in ("16385", "63", "big"):
        with pytest.raises(ConfigError, match="QUEEN_JWT_MAX_BYTES"):
            Settings.from_env({**base, "QUEEN_JWT_MAX_BYTES": bad})


@pytest.mark.parametrize("kind, alg", [("rsa", "RS256"), ("ec", "ES256"), ("ed25519", "EdDSA")])
def test_a_token_the_public_key_did_not_sign_never_reaches_pyjwt(monkeypatch, kind, alg):
    """QUEEN_JWT_PUBLIC_KEY: the signature checked first, by the one algorithm the key's type
    allows; another key's token, HS256 with the PEM as its secret, and a signature of the
    wrong length never reach jwt.decode; the key's own token does, once."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    from queen_timers import auth

    def private():
        return {"rsa": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
                "ec": lambda: ec.generate_private_key(ec.SECP256R1()),
                "ed25519": ed25519.Ed25519PrivateKey.generate}[kind]()
    key, other = private(), private()
    pem = pem_of(key)
    a, check, decoded = counting_authenticator(monkeypatch, jwt_public_key=pem)
    assert a.public_key is not None
    claims = {"sub": "billing-service", "tenant": "globex", "role": "read-only", "exp": int(time.time()) + 600}
    confused = hs256_under(pem, claims)
    good = jwt.encode(claims, key, algorithm=alg)
    forged = jwt.encode({**claims, "pad": "p" * 5000}, other, algorithm=alg)
    for bad in (forged, confused, good.rpartition(".")[0] + "." + "A" * 2000, good[:-4]):
        found = check(bad)
        assert isinstance(found, auth.ApiError) and found.status == 401, found
        assert "Signature verification failed" in found.detail, found.detail
    assert decoded == []
    for _ in range(3):
        assert check(good) == auth.Principal(tenant="globex", sub="billing-service", role="read-only")
    assert decoded == [1]


def test_a_tenant_claim_over_255_bytes_is_401_and_one_at_255_is_served(jwt_client, db):
    # the tenant is a key of every table: a ~1,900-byte tenant's writes failed with a 54000
    # (index row too big; Dec 7 audit). 255 bytes of UTF-8, as every other name.
    assert_refused_401(jwt_client, db, bearer(tenant="é" * 128), "at most 255")  # 256 bytes
    at_limit = "t" * 255
    r = jwt_client.post("/api/v1/timers", json={"operations": [op("schedule", "k")]},
                        headers=bearer(tenant=at_limit))
    assert r.status_code == 200, r.text
    assert db.execute("SELECT tenant FROM queen.timers").fetchone()["tenant"] == at_limit


def test_a_sub_claim_over_255_bytes_is_401_and_one_at_255_is_stamped_whole(jwt_client, db):
    # the sub is stamped on every timer and frame (producerSub): one of 8 KB made each popped
    # message weigh more than the body budget counted for it. OpenID Connect's bound, 255.
    assert_refused_401(jwt_client, db, bearer(sub="é" * 128), "sub claim is 256 bytes of UTF-8; at most 255")
    at_limit = "é" * 127 + "s"  # 255 bytes
    r = jwt_client.post("/api/v1/timers", json={"operations": [op("schedule", "k")]},
                        headers=bearer(sub=at_limit))
    assert r.status_code == 200, r.text
    assert db.execute("SELECT producer_sub FROM queen.timers").fetchone()["producer_sub"] == at_limit


@pytest.mark.parametrize("kind, fmt, alg", [("ed25519", "openssh", "EdDSA"), ("rsa", "openssh", "RS256"),
                                            ("ed448", "pem", "EdDSA")])
def test_an_openssh_or_ed448_public_key_verifies_its_tokens_and_no_other(monkeypatch, kind, fmt, alg):
    """QUEEN_JWT_PUBLIC_KEY as docs/configuration.md gives it: a PEM, or an OpenSSH public key
    line (`ssh-ed25519 AAAA...`), of RSA, EC P-256, Ed25519 or Ed448. The key's own token is
    served; another key's of the same type is 401."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed448, ed25519, rsa

    from queen_timers import auth

    def private():
        return {"rsa": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
                "ed25519": ed25519.Ed25519PrivateKey.generate, "ed448": ed448.Ed448PrivateKey.generate}[kind]()
    key, other = private(), private()
    text = (key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
            if fmt == "openssh" else pem_of(key))
    assert text.startswith("ssh-" if fmt == "openssh" else "-----BEGIN PUBLIC KEY-----")
    a, check, _ = counting_authenticator(monkeypatch, jwt_public_key=text)
    assert a.public_key is not None
    claims = {"sub": "billing-service", "tenant": "globex", "role": "read-only", "exp": int(time.time()) + 600}
    assert check(jwt.encode(claims, key, algorithm=alg)) == auth.Principal(tenant="globex", sub="billing-service",
                                                                          role="read-only")
    found = check(jwt.encode(claims, other, algorithm=alg))
    assert isinstance(found, auth.ApiError) and found.status == 401, found


@pytest.mark.parametrize("kind", ["secret", "ed25519"])
def test_a_token_refused_for_good_is_remembered_and_a_token_not_yet_valid_is_not(monkeypatch, kind):
    """A client repeating a refused token (another key's, expired, a claim that never
    passes) costs the broker a digest and a lookup from its second request on: the
    signature is checked once, and every answer is the first one's 401. A token refused
    only because its nbf lies ahead is checked again each time (it may pass later), and
    the memory is bounded, the oldest refusal first out."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from queen_timers import auth
    if kind == "secret":
        a, check, decoded = counting_authenticator(monkeypatch, jwt_secret=JWT_SECRET)

        def sign(claims, other=False):
            return jwt.encode(claims, "another-secret-of-at-least-32-bytes-long!" if other else JWT_SECRET,
                              algorithm="HS256")
    else:
        key, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
        a, check, decoded = counting_authenticator(monkeypatch, jwt_public_key=pem_of(key))

        def sign(claims, other=False):
            return jwt.encode(claims, stranger if other else key, algorithm="EdDSA")
    signed = []
    real_signed = a._signed
    monkeypatch.setattr(a, "_signed", lambda token: signed.append(1) or real_signed(token))
    now = int(time.time())
    claims = {"sub": "billing-service", "tenant": "acme", "role": "admin", "exp": now + 600}
    cases = {
        "Signature verification failed": sign(claims, other=True),
        "expired": sign({**claims, "exp": now - 3600}),
        "role claim must be one of": sign({**claims, "role": "root"}),
    }
    for part, bad in cases.items():
        first = check(bad)
        assert isinstance(first, auth.ApiError) and first.status == 401 and part in first.detail, first
        calls_before = (len(signed), len(decoded))
        for _ in range(3):
            again = check(bad)
            assert isinstance(again, auth.ApiError) and again.status == 401
            assert again.body() == first.body()
        assert (len(signed), len(decoded)) == calls_before, f"{part}: checked once, then remembered"
    assert len(a.refused) == 3

    early = sign({**claims, "nbf": now + 3600})
    for _ in range(2):
        found = check(early)
        assert isinstance(found, auth.ApiError) and "not yet valid" in found.detail, found
    assert len(a.refused) == 3, "a token not yet valid is never remembered"
    assert check(sign(claims)).tenant == "acme", "a good token still passes"

    monkeypatch.setattr(auth, "REFUSED_TOKENS", 4)
    checked = len(signed)
    for i in range(3):  # two more refusals past the bound push out the two oldest
        check(sign({**claims, "role": f"nobody-{i}"}))
    assert len(a.refused) == 4
    check(cases["Signature verification failed"])
    assert len(signed) == checked + 4, "the oldest refusal was forgotten and checked again"
