"""Ranks on several machines (notebooks 09a and 10a): what crosses between machines, and how they start, beat and
stop together. The core reaches them through the names below only, and only where an engine spans machines."""
from .multinode import (STALE_S, GlooCommandChannel, HeartbeatMonitor, command_group, new_engine_key, node_claimed,
                        node_label, prove_membership, publish_engine)
from .wire import SECRET_ENV, ClusterKey, new_secret, secret_from_env

__all__ = ["STALE_S", "GlooCommandChannel", "HeartbeatMonitor", "command_group", "new_engine_key", "node_claimed", "node_label",
           "prove_membership", "publish_engine", "SECRET_ENV", "ClusterKey", "new_secret", "secret_from_env"]
