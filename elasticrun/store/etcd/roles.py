"""The built-in store's roles, as etcd users and roles with key-prefix permissions.

`elasticrun store etcd-roles` runs `set_up` as a user of etcd's root role:

    role / user          permission                      for
    elasticrun-admin     readwrite on /elasticrun/       agents, job control (stop, drain, join)
    elasticrun-reader    read on /elasticrun/            status, list, logs, scrapers

Each user gets the role of its name, and the password given for it (a user already there
gets its password changed, so running it again rotates them). Every job keeps its keys
under `/elasticrun/<rdzv-id>/`, so these two prefixes are all elasticrun ever touches.

Workers get no etcd credential at all: the agent keeps etcd's password from their
environment (`password_env` is withheld, `password_file` is the agent's), and the
workers' token file exists for the built-in store only. Where the built-in store gives
each job's workers a namespace of their own, etcd gives them nothing, which is less.

Turning authentication on is left to the operator (`etcdctl user add root`,
`etcdctl auth enable`): it locks out every client without a user, which is a decision
about the whole cluster, not about elasticrun's part of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pyetcd import etcdrpc

from elasticrun.store.credentials import JOBS_PREFIX
from elasticrun.store.etcd.backend import EtcdStore, prefix_range


@dataclass(frozen=True, slots=True)
class EtcdRole:
    """An etcd role and the user of the same name that holds it."""

    name: str
    #: etcd's Permission.Type: READ, WRITE or READWRITE
    permission: int
    what: str


ADMIN = EtcdRole("elasticrun-admin", etcdrpc.Permission.READWRITE, "readwrite")
READER = EtcdRole("elasticrun-reader", etcdrpc.Permission.READ, "read")
ROLES = (ADMIN, READER)


async def set_up(store: EtcdStore, passwords: Mapping[EtcdRole, str]) -> list[str]:
    """Create or update each role of `passwords` and its user; one line per step done."""
    key, range_end = prefix_range(JOBS_PREFIX)
    roles = set((await store.auth("RoleList", etcdrpc.AuthRoleListRequest())).roles)
    users = set((await store.auth("UserList", etcdrpc.AuthUserListRequest())).users)
    done = []
    for role, password in passwords.items():
        if role.name not in roles:
            await store.auth("RoleAdd", etcdrpc.AuthRoleAddRequest(name=role.name))
            done.append(f"role {role.name} created")
        permission = etcdrpc.Permission(permType=role.permission, key=key, range_end=range_end)
        await store.auth("RoleGrantPermission", etcdrpc.AuthRoleGrantPermissionRequest(name=role.name, perm=permission))
        done.append(f"role {role.name}: {role.what} on {JOBS_PREFIX}")
        if role.name in users:
            request = etcdrpc.AuthUserChangePasswordRequest(name=role.name, password=password)
            await store.auth("UserChangePassword", request)
            done.append(f"user {role.name}: password set")
        else:
            await store.auth("UserAdd", etcdrpc.AuthUserAddRequest(name=role.name, password=password))
            done.append(f"user {role.name} created")
        await store.auth("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=role.name, role=role.name))
        done.append(f"user {role.name}: role {role.name}")
    return done
