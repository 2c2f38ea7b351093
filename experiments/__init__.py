"""shoal.experiments: tasks, configs, the ``shoal-run`` runner and its reports."""
