"""The parts ``fleet serve`` is composed of, each owning its state and handed its collaborators
(objects or callables) when ``agent.fleet.service.assemble`` wires them:

- ``intake`` (``Intake``): the controller's subscriptions, each MQTT event routed to its part;
- ``registry`` (``DeviceRegistry``): births, models messages and telemetry into the database
  in bounded batches; what each device says it understands;
- ``admission`` (``AdmissionPart``): the admission gate's glue, the roll call, births
  acknowledged, the call;
- ``outbox`` (``Publisher``): decisions saved with their messages under the lease, sent through
  the send gate, PUBACKs collected;
- ``artifacts`` (``ArtifactServing``): artifact blocks over MQTT, offers over HTTP;
- ``engine_sharing`` (``EngineSharing``): builders' engines handed to their classes;
- ``rollout_driver`` (``RolloutDriver``): the rollouts held here, fed statuses, streamed,
  evaluated, controlled; ``adoption`` (``Adoption``): leases claimed, rollouts taken on;
  ``rereading`` (``Rereader``): statuses that never came, read again;
- ``deployments`` (``DeploymentsHook``): the deployment runner, told what changed.

May import ``database``, ``transfer``, ``admission``, ``rollouts``, ``deployments`` and the base
modules; only the wiring (``agent.fleet.service``) imports the parts.
"""
