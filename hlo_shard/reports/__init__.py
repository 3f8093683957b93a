"""Cost reports: the documents ``report``, ``diff`` and ``scale`` print, and their formats."""
