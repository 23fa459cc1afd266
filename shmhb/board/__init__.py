"""The board: one host's liveness table in POSIX shared memory, and everything that
reads or writes it without a network.

The lowest layer but for the package's shared vocabulary (``shmhb.errors``,
``shmhb.status``, ``shmhb.clock``, ``shmhb.ratelog``, ``shmhb.periodic``,
``shmhb.procinfo``, ``shmhb.timens``, ``shmhb.version``, the modules at the top of the
package).  In reading order:

- the byte map and the bit map of every word, and their one decoder: ``layout``,
  ``words``; the judging of words into statuses: ``judge``;
- the values stored and checked at its doors: ``address``, ``config`` (policy,
  capacity, settings values), ``records``;
- the mapping and its locks: ``segment``, ``locks``, ``registrylock``, ``native`` (the
  switch to the C hot paths, ``shmhb._native``);
- the handle: ``handle`` (``Board``: lifecycle, registration) over ``core`` (the views,
  and ``BoardWords``, the surface of the words' writers) and ``localreads`` (the hot
  local reads), owning ``remotereads`` (and, through ``BoardWords``, ``watchtable``);
  ``registration``; ``forgetting`` (clearing dead slots); ``heartbeat`` (a worker's beat);
- the header words other layers write, as readers see them: ``netword`` (the network
  half's state word; the agent role's terms are lock bytes, ``layout.term_byte``, and
  their election is ``shmhb.agent.election``);
- clients of the board that need no network: ``reaper`` (``LinkReaper``), ``instances``
  (serving instances read off the board).

May import: the top-level vocabulary modules and this folder, numpy and posix_ipc.
Imports neither zmq nor rich, nor any other folder of the package: every other layer is
built on this one.
"""
