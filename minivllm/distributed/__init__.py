"""Ranks as fresh processes (notebook 01), where they meet (notebook 01b), the group and the `Communicator` that every
parallel layer is handed (notebook 01c), and the loop a worker rank runs (notebook 01d). The rest of the package
imports these names from here."""
from .communicator import (Communicator, CountingCommunicator, NodeLayout, ProcessGroupCommunicator, default_backend,
                           default_device, divide, shutdown_groups)
from .processes import (PeerWatch, RankFailure, RankProcess, close_gloo_listeners, describe_exit, end_processes,
                        free_port, listen_socket, open_descriptors, process_state)
from .rendezvous import ClosableStore, SignedStore, StoreKey, store_server, torch_version, wait_for_ranks
from .worker import CommandReceiver, OwnerDied, worker_loop

__all__ = ["Communicator", "CountingCommunicator", "NodeLayout", "ProcessGroupCommunicator", "default_backend",
           "default_device", "divide", "shutdown_groups", "PeerWatch", "RankFailure", "RankProcess",
           "close_gloo_listeners", "describe_exit", "end_processes", "free_port", "listen_socket", "open_descriptors",
           "process_state", "ClosableStore", "SignedStore", "StoreKey", "store_server", "torch_version",
           "wait_for_ranks", "CommandReceiver", "OwnerDied", "worker_loop"]
