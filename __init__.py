"""Not a package: the root of a tplab checkout (the package is the `tplab/` folder in it).

When this folder is named `tplab` and Python runs in its parent directory (a notebook
kernel started there, or a rank), `import tplab` would find this folder first and, without
this file, make it an empty namespace package ("module 'tplab' has no attribute
'launch'"). This file makes that mistake say what it is (issue 38).
"""

import os as _os

if __name__ == "tplab":   # imported as the package (pytest's collection imports it by path)
    raise ImportError(
        f"the folder {_os.path.dirname(_os.path.abspath(__file__))} in the working directory "
        "is a checkout of tplab, not the package: Python imports it as `tplab` in place of "
        "the installed package (its `tplab/` folder). Start Jupyter or Python inside the "
        "checkout (cd into it) or from another directory, or rename the folder.")
