"""The decoupled syncer: merges what the learners have sent into new globals (``diloco.mode = "decoupled"``)."""
