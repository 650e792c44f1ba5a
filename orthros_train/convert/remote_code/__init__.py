"""Self-contained Hugging Face remote code for exported Orthros models.

``orthros-convert to-hf`` copies ``configuration_orthros.py`` and ``modeling_orthros.py`` into the
exported directory; they import only torch and transformers, so the export loads with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` without orthros_train.
"""

from pathlib import Path

REMOTE_CODE_FILES = ("configuration_orthros.py", "modeling_orthros.py")
REMOTE_CODE_DIR = Path(__file__).parent
