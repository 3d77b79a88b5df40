"""Faults a real-process test plants in a node it starts, without any of it in the product.

A test that needs a misbehaving node (a hop that lies, a node that claims
absurd speed) starts that node's process with this folder on PYTHONPATH and
``SHARDMESH_TEST_FAULT=<module>[:<argument>]``. Python imports this file at
interpreter start (the ``site`` module imports any ``sitecustomize`` on the
path); it imports ``<module>`` from this folder and calls its
``install(argument)``, which patches the runtime before the node starts.
Nodes started without the variable are untouched, so a swarm can mix honest
nodes and one faulty one. See :func:`fault_env`.
"""

from __future__ import annotations

import importlib
import os

FAULT_ENV = "SHARDMESH_TEST_FAULT"

_spec = os.environ.get(FAULT_ENV)
if _spec:
    _module, _, _argument = _spec.partition(":")
    importlib.import_module(_module).install(_argument)
