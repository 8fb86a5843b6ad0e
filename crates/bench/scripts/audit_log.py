"""Reading the control plane's audit log, shared by the scripts that count a lane's writes."""
import json


def completed(path, verbs):
    """The requests of the audit log at `path` whose verb is in `verbs`, each once (its
    ResponseComplete event), as the decoded audit events."""
    with open(path) as log:
        for line in log:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("stage") == "ResponseComplete" and event.get("verb") in verbs:
                yield event
