"""What the controller hears from devices: which devices at all (``admission``: admission
states and pinned keys, the gate every device message passes), every one of them whatever the
broker's queue limits (``rollcall``), and how much of what each sends is kept (``bounds``).

May import: the base modules, plus ``wire``, ``engines``, ``precision``, ``platform``,
``calib``; nothing else of ``agent.fleet``.
"""
