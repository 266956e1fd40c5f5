"""Weight sync: learner rank 0 sends each new version to every generator, without stalling either.

One publish, in the order a reader meets it:

1. `sender.WeightSender.publish` copies the learner's tensors into its flat buckets as they come
   (`buckets.gather`, laid out by `buckets.plan`) and tells the service
   `Ready(version, manifest)` (every control message: `messages.py`);
2. `service.SyncState.on_ready` picks the round's members and answers `Go(members)`; each
   member's next `client.GeneratorSyncClient.poll` returns its `RoundInfo`;
3. both ends meet on the sender's rendezvous store, `round.RoundStore`: members say `join`, the
   sender writes each attempt's roster, they build the attempt's group and the sender broadcasts
   the buckets (`sender._run_round` on one side, `receiver.receive_buckets` on the other);
4. the generator's engine loads the views (`actors.engines.vllm.worker`, `receiver.receive_into_model`),
   stamps itself with the round's version and reports `Done`; the sender reports `RoundResult`.

Imports nothing of the project but `common/`.
"""
