"""What an RL trainer imports to push new weights into a running server: the process group both
sides join (weight_group.py) and the trainer's HTTP helper (trainer_client.py). torch only, no
engine code: the engine's side (engine/weight_updates.py) imports weight_group from here."""
