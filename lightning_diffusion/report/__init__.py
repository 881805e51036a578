"""``lightning-diffusion report``: one self-contained HTML page of an output folder (or bucket).

``collect`` reads what a run recorded (every manifest line that counts, the failed and rejected
records, run.json's history), ``pace`` and ``cost`` turn the times into images per minute per worker
and images per device-hour, ``thumbs`` makes the thumbnails once beside the outputs, ``plots`` draws
the pace with matplotlib and ``page`` writes the HTML. Nothing here imports torch or Lightning.
"""
