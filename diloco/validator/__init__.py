"""The validator: a process with the run's task that scores learners' recent pushes by
the held-out loss change they cause and lowers the merge weight of those that raise it
(``diloco validator``; docs/ARCHITECTURE.md, "Trust")."""
