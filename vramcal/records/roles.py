"""Setting up a fleet's PostgreSQL store: schema, an owner role and a writer role.

``init_fleet(admin_url)`` connects as an administrator (a superuser, or a role that may create roles
and is a member of the owner role) and:

1. creates the roles if they are missing: the **owner** (``vramcal_owner``, no login unless given a
   password) owns the schema and every table and may upgrade them; the **writer**
   (``vramcal_writer``, login) is what every host puts in its ``--db`` URL;
2. creates schema ``vramcal`` owned by the owner and brings it to the current schema version *as the
   owner* (the same migrations as any store; they install the append-only triggers);
3. grants the writer ``USAGE`` on the schema, ``SELECT, INSERT`` on the history tables, ``SELECT`` on
   ``meta`` and ``USAGE`` on the sequences; no ``UPDATE``, ``DELETE`` or ``TRUNCATE`` (revoked
   explicitly, from ``PUBLIC`` too), and the same by default for tables a later upgrade adds.

So the server refuses a writer's ``UPDATE``/``DELETE`` (no privilege), and the triggers refuse them
even to the owner (grants cannot stop a table's owner). Upgrading a later schema is the owner's job:
run ``init_fleet`` again with the new vramcal. Re-running it is safe; it changes nothing that is
already right. The equivalent SQL is in docs/fleet.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UserError
from .engines import DEVICE_TABLES, HISTORY_TABLES, PG_SCHEMA, WITHDRAWAL_TABLES, _one_line, _psycopg, is_url, redact
from .schema import SCHEMA_VERSION
from .store import Store

OWNER = "vramcal_owner"
WRITER = "vramcal_writer"


@dataclass
class FleetInit:
    database: str  # the admin URL, without its password
    owner: str
    writer: str
    schema_version: int
    roles_created: list[str]
    writer_url: str  # the URL a host puts in --db, without a password

    def to_dict(self) -> dict:
        return asdict(self)


def init_fleet(admin_url: str, *, owner: str = OWNER, writer: str = WRITER, writer_password: str | None = None,
               owner_password: str | None = None) -> FleetInit:
    if not is_url(admin_url):
        raise UserError("init-fleet sets up a PostgreSQL store: give --db postgresql://ADMIN@HOST/DATABASE")
    for role, password in (("writer", writer_password), ("owner", owner_password)):
        if password is not None and (not isinstance(password, str) or not password):
            raise UserError(f"an empty {role} password would clear the {role} role's password on the whole server "
                            "(roles are cluster-wide): give a password, or none to keep it")
    psycopg = _psycopg()
    from psycopg import sql

    label = redact(admin_url)
    try:
        admin = psycopg.connect(admin_url, autocommit=True, connect_timeout=30)
    except psycopg.Error as exc:
        raise UserError(f"cannot connect to {label} as an administrator: {redact(_one_line(exc))}") from None
    created: list[str] = []
    try:
        with admin:
            existing = {r[0] for r in admin.execute("SELECT rolname FROM pg_roles WHERE rolname IN (%s, %s)",
                                                    (owner, writer))}
            for role, login, password in ((owner, bool(owner_password), owner_password),
                                          (writer, True, writer_password)):
                verb = "ALTER" if role in existing else "CREATE"
                if verb == "CREATE":
                    created.append(role)
                if verb == "ALTER" and password is None:
                    continue
                stmt = sql.SQL(f"{verb} ROLE {{}} {'LOGIN' if login else 'NOLOGIN'}").format(sql.Identifier(role))
                if password is not None:
                    stmt = sql.SQL("{} PASSWORD {}").format(stmt, sql.Literal(password))
                admin.execute(stmt)
            me = admin.execute("SELECT current_user").fetchone()[0]
            is_super = admin.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]
            if not is_super:
                admin.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(owner), sql.Identifier(me)))
            admin.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {} AUTHORIZATION {}").format(
                sql.Identifier(PG_SCHEMA), sql.Identifier(owner)))
            admin.execute(sql.SQL("ALTER SCHEMA {} OWNER TO {}").format(sql.Identifier(PG_SCHEMA),
                                                                        sql.Identifier(owner)))
            # tables an earlier `vramcal check --db ADMIN_URL` created belong to the owner from now on
            for kind, name in admin.execute(
                    "SELECT 'TABLE', tablename FROM pg_tables WHERE schemaname = %s "
                    "UNION ALL SELECT 'SEQUENCE', sequencename FROM pg_sequences WHERE schemaname = %s",
                    (PG_SCHEMA, PG_SCHEMA)).fetchall():
                admin.execute(sql.SQL(f"ALTER {kind} {{}}.{{}} OWNER TO {{}}").format(
                    sql.Identifier(PG_SCHEMA), sql.Identifier(name), sql.Identifier(owner)))
    except psycopg.Error as exc:
        raise UserError(f"setting up the roles on {label} failed: {redact(_one_line(exc))}: connect as a superuser "
                        "or a role with CREATEROLE") from None

    with Store(admin_url, role=owner) as store:  # creates or upgrades the schema as the owner
        version = SCHEMA_VERSION
        store.engine.write(lambda tx: _grant(tx, owner, writer))

    info = psycopg.conninfo.conninfo_to_dict(admin_url)
    host = info.get("host") or "localhost"
    port = f":{info['port']}" if info.get("port") else ""
    writer_url = f"postgresql://{writer}@{host}{port}/{info.get('dbname') or ''}"
    if info.get("sslmode"):
        writer_url += f"?sslmode={info['sslmode']}"
    return FleetInit(label, owner, writer, version, created, writer_url)


def _grant(tx, owner: str, writer: str) -> None:
    from psycopg import sql

    w, o, s = sql.Identifier(writer), sql.Identifier(owner), sql.Identifier(PG_SCHEMA)
    tables = sql.SQL(", ").join(sql.Identifier(PG_SCHEMA, t) for t in HISTORY_TABLES + DEVICE_TABLES
                            + WITHDRAWAL_TABLES)
    conn = tx.conn
    conn.execute(sql.SQL("REVOKE ALL ON SCHEMA {} FROM PUBLIC").format(s))
    conn.execute(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM PUBLIC").format(s))
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, w))
    conn.execute(sql.SQL("REVOKE UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA {} FROM {}").format(s, w))
    conn.execute(sql.SQL("GRANT SELECT, INSERT ON {} TO {}").format(tables, w))
    conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(sql.Identifier(PG_SCHEMA, "meta"), w))
    conn.execute(sql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(s, w))
    conn.execute(sql.SQL("ALTER DEFAULT PRIVILEGES FOR ROLE {} IN SCHEMA {} GRANT SELECT, INSERT ON TABLES TO {}")
                 .format(o, s, w))
    conn.execute(sql.SQL("ALTER DEFAULT PRIVILEGES FOR ROLE {} IN SCHEMA {} GRANT USAGE ON SEQUENCES TO {}")
                 .format(o, s, w))
