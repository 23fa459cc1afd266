"""The host agent: the role that one process per host holds, running the local death
watch and the network half in one loop.

- ``role`` (``Agent``: election, takeover, stand-down), ``election`` (terms of the role
  as lock bytes, and how a stalled holder is replaced), ``embedded`` (the package's
  ``Board``, whose registrations run the agent inside the worker);
- ``loop`` (the poll loop and its components), ``writer`` (the header words the role
  holder writes), ``localwatch`` (local workers' deaths, from pidfds and silence).

May import: the top-level vocabulary modules, ``shmhb.board``, ``shmhb.net`` and this
folder.  Never ``shmhb.cli``, ``shmhb.testing`` or ``shmhb.vllm``.
"""
