"""The outer state and where it goes: the global model and its Nesterov step (outer), its file (file), the
directory of files written in the background (store), this peer's checkpoints (checkpoints), and getting the
swarm's state by download or replay (sync, replay); ``context`` is what the state and round code may use of the
peer. Imports ``averager``, ``events`` and below."""
