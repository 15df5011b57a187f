"""cffi binding of the DOCA functions bluecache calls (libdoca_common + libdoca_dma).

Two ways in, one set of declarations:

- API mode: `bluecached.dma._doca_api`, compiled against NVIDIA's headers by
  native/build_doca_api.py where pkg-config finds `doca-dma` (on the DPU; docs/hardware.md).
  The compiler checks every declaration and enum value below against the real headers, and
  `union doca_data` is passed by value as the C ABI says.
- ABI mode: `ffi.dlopen` of a library path: the DOCA API simulator (native/doca_sim, built with
  the package) or a real libdoca_dma.so.2 when the API module was not built. cffi's ABI mode
  cannot pass unions by value, so `union doca_data` is declared as the uint64_t it is on the
  x86-64 and AArch64 calling conventions (an 8-byte union of integer class travels in one
  general-purpose register, exactly like a uint64_t).

Errors become DocaError carrying doca_error_get_name / doca_error_get_descr.
"""

import importlib.util
import logging
import os

from cffi import FFI

log = logging.getLogger("bluecached.dma.doca")

SYSTEM_LIBRARY = "libdoca_dma.so.2"   # depends on libdoca_common.so.2, where mmap/buf/pe live
MIN_VERSION = (2, 7)                   # the doca_pe / doca_comch generation

_ERRORS = ("SUCCESS UNKNOWN NOT_PERMITTED IN_USE NOT_SUPPORTED AGAIN INVALID_VALUE NO_MEMORY "
           "INITIALIZATION TIME_OUT SHUTDOWN CONNECTION_RESET CONNECTION_ABORTED "
           "CONNECTION_INPROGRESS NOT_CONNECTED NO_LOCK NOT_FOUND IO_FAILED BAD_STATE "
           "UNSUPPORTED_VERSION OPERATING_SYSTEM DRIVER UNEXPECTED ALREADY_EXIST FULL EMPTY "
           "IN_PROGRESS TOO_BIG AUTHENTICATION BAD_CONFIG SKIPPED").split()

_ERROR_ENUM = ",\n".join(
    f"    {'DOCA_SUCCESS' if i == 0 else 'DOCA_ERROR_' + name} = {i}"
    for i, name in enumerate(_ERRORS))

# DATA is `union doca_data` (API mode) or `uint64_t` (ABI mode); see the module docstring.
CDEF = """
typedef enum doca_error {
ERRORS
} doca_error_t;

enum doca_access_flag {
    DOCA_ACCESS_FLAG_LOCAL_READ_ONLY = 0,
    DOCA_ACCESS_FLAG_LOCAL_READ_WRITE = 1,
    DOCA_ACCESS_FLAG_PCI_READ_ONLY = 16,
    DOCA_ACCESS_FLAG_PCI_READ_WRITE = 32
};

enum doca_ctx_states {
    DOCA_CTX_STATE_IDLE = 0,
    DOCA_CTX_STATE_STARTING = 1,
    DOCA_CTX_STATE_RUNNING = 2,
    DOCA_CTX_STATE_STOPPING = 3
};

struct doca_devinfo;
struct doca_dev;
struct doca_mmap;
struct doca_buf;
struct doca_buf_inventory;
struct doca_pe;
struct doca_ctx;
struct doca_task;
struct doca_dma;
struct doca_dma_task_memcpy;

typedef void (*doca_dma_task_memcpy_completion_cb_t)(struct doca_dma_task_memcpy *task,
                                                     DATA task_user_data, DATA ctx_user_data);

const char *doca_version_runtime(void);
const char *doca_error_get_name(doca_error_t error);
const char *doca_error_get_descr(doca_error_t error);

doca_error_t doca_devinfo_create_list(struct doca_devinfo ***dev_list, uint32_t *nb_devs);
doca_error_t doca_devinfo_destroy_list(struct doca_devinfo **dev_list);
doca_error_t doca_devinfo_get_pci_addr_str(const struct doca_devinfo *devinfo, char *pci_addr_str);
doca_error_t doca_devinfo_is_equal_pci_addr(const struct doca_devinfo *devinfo,
                                            const char *pci_addr_str, uint8_t *is_equal);
doca_error_t doca_dev_open(struct doca_devinfo *devinfo, struct doca_dev **dev);
doca_error_t doca_dev_close(struct doca_dev *dev);
struct doca_devinfo *doca_dev_as_devinfo(const struct doca_dev *dev);

doca_error_t doca_mmap_create(struct doca_mmap **mmap);
doca_error_t doca_mmap_destroy(struct doca_mmap *mmap);
doca_error_t doca_mmap_start(struct doca_mmap *mmap);
doca_error_t doca_mmap_stop(struct doca_mmap *mmap);
doca_error_t doca_mmap_add_dev(struct doca_mmap *mmap, struct doca_dev *dev);
doca_error_t doca_mmap_set_permissions(struct doca_mmap *mmap, uint32_t access_mask);
doca_error_t doca_mmap_set_memrange(struct doca_mmap *mmap, void *addr, size_t len);
doca_error_t doca_mmap_set_dmabuf_memrange(struct doca_mmap *mmap, int dmabuf_fd, void *addr,
                                           size_t dmabuf_offset, size_t len);
doca_error_t doca_mmap_get_memrange(const struct doca_mmap *mmap, void **addr, size_t *len);
doca_error_t doca_mmap_export_pci(struct doca_mmap *mmap, const struct doca_dev *dev,
                                  const void **export_desc, size_t *export_desc_len);
doca_error_t doca_mmap_create_from_export(const DATA *user_data, const void *export_desc,
                                          size_t export_desc_len, struct doca_dev *dev,
                                          struct doca_mmap **mmap);

doca_error_t doca_buf_inventory_create(size_t num_elements, struct doca_buf_inventory **inventory);
doca_error_t doca_buf_inventory_destroy(struct doca_buf_inventory *inventory);
doca_error_t doca_buf_inventory_start(struct doca_buf_inventory *inventory);
doca_error_t doca_buf_inventory_stop(struct doca_buf_inventory *inventory);
doca_error_t doca_buf_inventory_get_num_free_elements(const struct doca_buf_inventory *inventory,
                                                      uint32_t *num_of_free_elements);
doca_error_t doca_buf_inventory_buf_get_by_args(struct doca_buf_inventory *inventory,
                                                struct doca_mmap *mmap, void *addr, size_t len,
                                                void *data, size_t data_len,
                                                struct doca_buf **buf);
doca_error_t doca_buf_dec_refcount(struct doca_buf *buf, uint16_t *refcount);
doca_error_t doca_buf_get_data_len(const struct doca_buf *buf, size_t *data_len);

doca_error_t doca_pe_create(struct doca_pe **pe);
doca_error_t doca_pe_destroy(struct doca_pe *pe);
uint8_t doca_pe_progress(struct doca_pe *pe);
doca_error_t doca_pe_connect_ctx(struct doca_pe *pe, struct doca_ctx *ctx);
doca_error_t doca_pe_get_num_inflight_tasks(const struct doca_pe *pe, size_t *num_inflight_tasks);
doca_error_t doca_task_submit(struct doca_task *task);
void doca_task_free(struct doca_task *task);
doca_error_t doca_task_get_status(const struct doca_task *task);

doca_error_t doca_ctx_start(struct doca_ctx *ctx);
doca_error_t doca_ctx_stop(struct doca_ctx *ctx);
doca_error_t doca_ctx_get_state(const struct doca_ctx *ctx, enum doca_ctx_states *state);

doca_error_t doca_dma_create(struct doca_dev *dev, struct doca_dma **dma);
doca_error_t doca_dma_destroy(struct doca_dma *dma);
struct doca_ctx *doca_dma_as_ctx(struct doca_dma *dma);
doca_error_t doca_dma_cap_get_max_num_tasks(struct doca_dma *dma, uint32_t *max_num_tasks);
doca_error_t doca_dma_cap_task_memcpy_is_supported(const struct doca_devinfo *devinfo);
doca_error_t doca_dma_cap_task_memcpy_get_max_buf_size(const struct doca_devinfo *devinfo,
                                                       uint64_t *buf_size);
doca_error_t doca_dma_task_memcpy_set_conf(struct doca_dma *dma,
                                           doca_dma_task_memcpy_completion_cb_t task_completion_cb,
                                           doca_dma_task_memcpy_completion_cb_t task_error_cb,
                                           uint32_t num_memcpy_tasks);
doca_error_t doca_dma_task_memcpy_alloc_init(struct doca_dma *dma, const struct doca_buf *src,
                                             struct doca_buf *dst, DATA user_data,
                                             struct doca_dma_task_memcpy **task);
struct doca_task *doca_dma_task_memcpy_as_task(struct doca_dma_task_memcpy *task);
const struct doca_buf *doca_dma_task_memcpy_get_src(const struct doca_dma_task_memcpy *task);
struct doca_buf *doca_dma_task_memcpy_get_dst(const struct doca_dma_task_memcpy *task);
""".replace("ERRORS", _ERROR_ENUM)

# API mode only: the completion callback as a C function cffi generates.
API_CALLBACK = """
union doca_data { void *ptr; uint64_t u64; };
extern "Python" void bc_doca_memcpy_completed(struct doca_dma_task_memcpy *task,
                                              union doca_data task_user_data,
                                              union doca_data ctx_user_data);
"""


def cdef(api_mode: bool) -> str:
    text = CDEF.replace("DATA", "union doca_data" if api_mode else "uint64_t")
    return (API_CALLBACK + text) if api_mode else text


class DocaError(Exception):
    """A DOCA call failed: the doca_error_t with its name and description."""

    def __init__(self, code: int, name: str, descr: str, what: str):
        super().__init__(f"{what}: {name} ({descr})")
        self.code, self.name, self.descr, self.what = code, name, descr, what


class DocaLibrary:
    """The loaded functions plus what the caller must know about how they were loaded."""

    def __init__(self, ffi, lib, api_mode: bool, origin: str, simulated: bool):
        self.ffi, self.lib, self.api_mode = ffi, lib, api_mode
        self.origin, self.simulated = origin, simulated
        self.version = ffi.string(lib.doca_version_runtime()).decode()
        self._on_completion = None
        if api_mode:
            @ffi.def_extern(name="bc_doca_memcpy_completed")
            def _completed(task, task_data, ctx_data):
                self._on_completion(task, task_data.u64)
            self.completion_cb = lib.bc_doca_memcpy_completed
        else:
            self.completion_cb = ffi.callback(
                "void(struct doca_dma_task_memcpy *, uint64_t, uint64_t)",
                lambda task, task_data, ctx_data: self._on_completion(task, task_data))

    @property
    def description(self) -> str:
        kind = "SIMULATOR (no BlueField)" if self.simulated else "DOCA"
        mode = "API mode" if self.api_mode else "ABI mode"
        return f"{kind} {self.version}, {mode}, {self.origin}"

    def set_completion_handler(self, handler) -> None:
        """handler(task, user_data: int), called inside doca_pe_progress. One per library:
        the engine owns it (DOCA calls the C callback with no Python context)."""
        self._on_completion = handler

    def data(self, value: int):
        """A `union doca_data` argument holding the integer `value`."""
        if self.api_mode:
            return self.ffi.new("union doca_data *", {"u64": value})[0]
        return value

    def error(self, code: int, what: str) -> DocaError:
        lib, ffi = self.lib, self.ffi
        return DocaError(code, ffi.string(lib.doca_error_get_name(code)).decode(),
                         ffi.string(lib.doca_error_get_descr(code)).decode(), what)

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise self.error(code, what)


def simulator_path() -> str | None:
    spec = importlib.util.find_spec("bluecached.dma._doca_sim")
    return spec.origin if spec else None


def _version_ok(version: str) -> bool:
    try:
        major, minor = (int(x) for x in version.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= MIN_VERSION


_loaded: dict[str, DocaLibrary] = {}


def load(library: str) -> DocaLibrary:
    """`simulator`, `system` (the API-mode module if built, else libdoca_dma.so.2) or the
    absolute path of a library exporting the DOCA symbols. Loaded once per process."""
    if library in _loaded:
        return _loaded[library]
    if library == "simulator":
        path = simulator_path()
        if path is None:
            raise OSError("the DOCA API simulator is not built (reinstall the package)")
        loaded = _abi(path, simulated=True)
    elif library == "system":
        try:
            from . import _doca_api
        except ImportError:
            loaded = _abi(SYSTEM_LIBRARY, simulated=False)
        else:
            loaded = DocaLibrary(_doca_api.ffi, _doca_api.lib, True,
                                 os.path.basename(_doca_api.__file__), simulated=False)
    else:
        loaded = _abi(library, simulated=os.path.realpath(library) ==
                      os.path.realpath(simulator_path() or ""))
    if not _version_ok(loaded.version):
        raise OSError(f"DOCA {loaded.version} is too old: bluecache needs "
                      f"{'.'.join(map(str, MIN_VERSION))} or newer")
    _loaded[library] = loaded
    return loaded


def _abi(path: str, simulated: bool) -> DocaLibrary:
    ffi = FFI()
    ffi.cdef(cdef(api_mode=False))
    try:
        lib = ffi.dlopen(path)
    except OSError as e:
        raise OSError(f"cannot load DOCA from {path}: {e}") from None
    return DocaLibrary(ffi, lib, False, path, simulated)


def open_device(doca: DocaLibrary, pci_address: str):
    """doca_dev_open of the device at `pci_address` ("03:00.0" or "0000:03:00.0")."""
    ffi, lib = doca.ffi, doca.lib
    devs = ffi.new("struct doca_devinfo ***")
    count = ffi.new("uint32_t *")
    doca.check(lib.doca_devinfo_create_list(devs, count), "doca_devinfo_create_list")
    try:
        seen = []
        equal = ffi.new("uint8_t *")
        name = ffi.new("char[16]")
        for i in range(count[0]):
            info = devs[0][i]
            doca.check(lib.doca_devinfo_is_equal_pci_addr(info, pci_address.encode(), equal),
                       f"doca_devinfo_is_equal_pci_addr({pci_address!r})")
            if equal[0]:
                dev = ffi.new("struct doca_dev **")
                doca.check(lib.doca_dev_open(info, dev), f"doca_dev_open({pci_address})")
                return dev[0]
            if lib.doca_devinfo_get_pci_addr_str(info, name) == 0:
                seen.append(ffi.string(name).decode())
    finally:
        lib.doca_devinfo_destroy_list(devs[0])
    raise OSError(f"no DOCA device at PCI address {pci_address} (found: "
                  f"{', '.join(seen) or 'none'})")
