"""Weight sync: learner rank 0 sends each new version to every generator, without stalling either.

One publish, in the order a reader meets it:

1. `sender.WeightSender.publish` copies the learner's tensors into its flat buckets as they come
   (`buckets.gather`, laid out by `buckets.plan`) and tells the service
   `Ready(version, manifest)` (every control message: `messages.py`);
2. the service (`service.py`, its sockets and loop; `state.SyncState`, its bookkeeping) picks
   the round's members and answers `Go(members)`; each member's next
   `client.GeneratorSyncClient.poll` returns its `RoundInfo`;
3. both ends meet on the sender's rendezvous store, `round.RoundStore`: members say `join`, the
   sender writes each attempt's roster, they build the attempt's group (`groups.py`: how a group
   is built, bounded and kept between rounds) and the sender broadcasts the buckets
   (`sender.WeightSender._run_round`, its attempts in `broadcast.Broadcast`, on one side;
   `receiver.receive_buckets` or `receiver.receive_streaming` on the other); a member on the
   sender's host reads the sender's shared-memory slot instead (`shm.py` the segment,
   `slot.py` the member's side);
4. the generator's engine loads the views (`actors.engines.vllm.worker`, `receiver.receive_into_model`;
   an adapter round: `adapter.py`), stamps itself with the round's version and reports `Done`; the
   sender reports `RoundResult`.

`service.run(cfg)` is the service's role (`python -m launch.weight_sync`). Imports nothing of the
project but `common/`.
"""
