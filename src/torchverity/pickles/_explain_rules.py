"""The table behind ``torchverity explain``: each known failure around saving and loading
as a regular expression over its message, with the cause, the fix and the command that
checks it. Order matters: the first rules are the most specific.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """A known error: the pattern that finds it, its cause, the fix and the command."""

    key: str
    pattern: re.Pattern[str]
    cause: str
    fix: str
    command: str
    unit: str


def _rule(key: str, pattern: str, cause: str, fix: str, command: str,
          unit: str = "occurrences") -> Rule:
    return Rule(key, re.compile(pattern, re.IGNORECASE | re.MULTILINE), cause, fix, command,
                unit)


# A row of transformers' LOAD REPORT. transformers 5 merges the rows of keys that differ
# only in their layer indices ('encoder.layer.{0, 1}.output.dense.weight', '{0...11}' for
# more than ten), so a key holds braces, commas and spaces.
_ROW_KEY = r"^(?P<key>(?:[\w.\-]|\{[\d, .]+\})+)\s*\|\s*"
_SHAPE = r"torch\.Size\(\[[\d, ]*\]\)"
# Opcodes of protocols 0 and 1 that torch's weights_only unpickler lacks (POP, DUP, FLOAT,
# INT, LONG, PERSID, STRING, BINSTRING, UNICODE, DICT, GET, INST, LIST, OBJ, PUT): "0", "2", ...
_PROTOCOL_0_OPERANDS = "|".join(str(ord(c)) for c in "012FILPSTVdgilop")
# Opcodes that protocols 3 to 5 added and the weights_only unpickler lacks: BINBYTES and
# SHORT_BINBYTES (3), SHORT_BINUNICODE ... FRAME (4), BYTEARRAY8 ... READONLY_BUFFER (5).
# STACK_GLOBAL (147) is left to numpy's header, whose first byte it is: a protocol-4
# pickle stops at its FRAME (149) before any STACK_GLOBAL.
_NEWER_PROTOCOL_OPERANDS = "|".join(
    map(str, (66, 67, 140, 141, 142, 144, 145, 146, 148, 149, 150, 151, 152)))
# Operands other rules name: a Git LFS pointer, an HTML page, an ONNX model, a numpy file.
_FORMAT_OPERANDS = "118|60|8|147"


# Order matters: the first rules are the most specific, and a message that
# matches several rules is explained by each (e.g. a WeightsUnpickler error
# about a numpy global and the generic weights_only note).
RULES: tuple[Rule, ...] = (
    _rule(
        "unsupported-global",
        r"Unsupported global: GLOBAL (?P<name>[\w.]+)|"
        r"Trying to load unsupported GLOBAL (?P<blocked>[\w.]+)|"
        r"Trying to call reduce for unrecognized function|"
        r"Can only (?:build|create new object for)[^\n]*?got <class '(?P<built>[\w.]+)'>",
        "torch.load(weights_only=True), the default since PyTorch 2.6, met a global outside its "
        "allowlist{detail}: the file pickles a custom class, a whole model or optimizer, "
        "numpy data or argparse.Namespace. torch names only one global per attempt.",
        "list every global the file needs in one pass and get the exact safe_globals code; "
        "allowlist only classes you trust, or convert the file to a plain state_dict. Never set "
        "weights_only=False or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for a file you did not make: "
        "it runs any code inside the file.",
        "torchverity scan {file}",
    ),
    _rule(
        "git-lfs-pointer",
        r"Unsupported operand 118\b|invalid load key, 'v'|"
        r"version https://git-lfs\.github\.com/spec|"
        r"cloned a repository without having git-lfs installed",
        "the file is a Git LFS pointer (a small text file starting 'version https://git-lfs'), "
        "not the weights: the repository was cloned or downloaded without LFS (byte 118 is 'v').",
        "fetch the real file: 'git lfs pull' in the clone, or download it again with "
        "huggingface-cli / hf_hub_download; then verify it.",
        "torchverity scan {file}",
    ),
    _rule(
        "html-page",
        r"Unsupported operand 60\b|invalid load key, '<'",
        "the file is an HTML page (an error, login or redirect page saved under the weights "
        "name), not a checkpoint (byte 60 is '<').",
        "download it again with a valid URL and token (huggingface-cli download, or the 'resolve' "
        "URL rather than the 'blob' page); then verify it.",
        "torchverity scan {file}",
    ),
    _rule(
        "onnx-model",
        r"Unsupported operand 8\b",
        "the file is most likely an ONNX model (protobuf; its first byte 0x08 opens the "
        "ir_version field), not a torch checkpoint: torch.load cannot read it.",
        "run it with onnxruntime (or onnx.load it); to see its weights, list its initializers.",
        "torchverity inspect {file}",
    ),
    _rule(
        "not-torch-save",
        r"Invalid magic number; corrupt file\?",
        "the file is neither a torch.save zip archive nor a legacy (pre-1.6) torch.save file "
        "whose first pickle is torch's magic number: a plain pickle (pickle.dump, "
        "joblib.dump), a file in another format, or a legacy checkpoint damaged at its start.",
        "find out which without running it: inspect names a plain pickle, a joblib file, a "
        "broken download or damage; read a plain pickle with the library that wrote it, once "
        "torchverity scan says it runs no code.",
        "torchverity inspect {file}",
    ),
    _rule(
        "torchscript-weights-only",
        r"Cannot use ``weights_only=True`` with TorchScript archives|"
        r"received a zip file that looks like a TorchScript archive",
        "the file is a TorchScript archive (torch.jit.save): it holds code, which "
        "torch.load(weights_only=True) refuses and torch.jit.load runs.",
        "extract its tensors without running its code (torchverity migrate), or load it with "
        "torch.jit.load only if you trust where it came from.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "transformers-unexpected",
        _ROW_KEY + r"UNEXPECTED\s*\|.*$",
        "transformers found weights in the file that the model does not have{detail}: another "
        "task head or architecture, a non-persistent buffer saved by an older version, or a "
        "prefix ('model.', 'module.').",
        "compare the file's tensor names with the model's; for a different head they can be "
        "ignored, otherwise build the model from the config saved with the weights.",
        "torchverity inspect {file}",
        unit="tensors",
    ),
    _rule(
        "transformers-missing",
        _ROW_KEY + r"MISSING\s*\|.*$",
        "transformers initialised at random the weights the file does not hold{detail}: "
        "another architecture or head, or an incomplete (sharded or interrupted) download.",
        "check that every shard is present and intact, and that the config matches the file; "
        "fine-tune if the head is new on purpose.",
        "torchverity verify {file}",
        unit="tensors",
    ),
    _rule(
        "transformers-mismatch",
        _ROW_KEY + r"MISMATCH\s*\|(?:[^\n]*?ckpt: (?P<ckpt>" + _SHAPE + r") vs model:\s*"
        r"(?P<model>" + _SHAPE + r"))?[^\n]*$|"
        r"(?P<summary>You set `ignore_mismatched_sizes` to `False`, thus raising an error)",
        "tensors in the file have other shapes than the model{detail}: the model was built "
        "with another configuration (vocabulary size, number of labels, width).",
        "build the model from the config.json saved with the weights; pass "
        "ignore_mismatched_sizes=True only to re-initialise a head on purpose.",
        "torchverity inspect {file}",
        unit="tensors",
    ),
    _rule(
        "numpy-npy",
        r"Unsupported operand 147\b",
        "the file is most likely a numpy array file (numpy.save), not a torch checkpoint: "
        "byte 147 (0x93) opens numpy's '\\x93NUMPY' header, where a pickle of protocol 2 "
        "or later opens with PROTO (byte 128).",
        "read it with numpy.load(path, allow_pickle=False); an object array holds a pickle, "
        "so check it before allowing pickles.",
        "torchverity scan {file}",
    ),
    _rule(
        "zip-not-torch",
        r"file in archive is not in a subdirectory",
        "the file is a zip archive torch.save did not write (torch.save puts every entry in "
        "one folder): most often a numpy .npz (numpy.savez), else another tool's archive.",
        "read a .npz with numpy.load(path, allow_pickle=False); otherwise check how the file "
        "was made (unzip -l lists its entries).",
        "torchverity scan {file}",
    ),
    _rule(
        "protocol-0-pickle",
        r"Unsupported operand (?P<opcode>" + _PROTOCOL_0_OPERANDS + r")\b",
        "the file is a pickle of protocol 0 or 1{detail}, whose opcodes are printable "
        "characters (as pickle.dumps(obj, 0) and Python 2 wrote them); torch's weights_only "
        "unpickler reads protocol 2 only.",
        "convert it without running its code: torchverity migrate writes a protocol-2 "
        "state_dict; or re-save it from trusted code with the default pickle_protocol=2.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "protocol-0-persistent-ids",
        r"saved_id must be a tuple, got str",
        "the file was saved with torch.save(..., pickle_protocol=0): protocol 0 writes each "
        "persistent id (torch's reference to a storage) as text, and torch.load reads only "
        "tuples, with or without weights_only: no torch.load reads such a file, damaged "
        "or not.",
        "convert it without running its code: torchverity migrate reads those ids by torch's "
        "exact grammar and writes the tensors bit for bit to a file torch.load and safetensors "
        "read; trust_sha256 or weights_only=False cannot help.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "unsupported-opcode",
        r"Unsupported operand (?P<opcode>" + _NEWER_PROTOCOL_OPERANDS + r")\b",
        "the file was pickled with protocol 3 or later{detail}, e.g. by pickle.dump or "
        "torch.save(pickle_protocol=4); torch's weights_only unpickler reads protocol 2 only.",
        "convert it without running its code: torchverity migrate writes a protocol-2 "
        "state_dict; or re-save it from trusted code with the default pickle_protocol=2.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "not-a-pickle-opcode",
        r"Unsupported operand (?!(?:" + _FORMAT_OPERANDS + "|" + _PROTOCOL_0_OPERANDS + "|"
        + _NEWER_PROTOCOL_OPERANDS + r")\b)(?P<byte>\d+)\b",
        "the file is not a pickle torch can read{detail}: it is damaged, or a file of another "
        "format saved under the checkpoint's name.",
        "see what the file is without running it: torchverity inspect names its format or its "
        "damage, torchverity scan FILE says whether it would run code; restore a good copy or "
        "download it again if it is damaged.",
        "torchverity inspect {file}",
    ),
    _rule(
        "weights-only-structure",
        r"Only persistent_load of storage is allowed|"
        r"Can only (?:SETITEMS?|append|extend)[^\n]*?(?:got <class '(?P<target>[\w.]+)'>|lists)",
        "the file holds a structure torch's weights_only unpickler cannot rebuild whatever you "
        "allowlist{detail}: a legacy (pre-1.6) file that pickles whole modules with their source, "
        "or a whole optimizer whose state is a defaultdict.",
        "convert it without running its code (the scan says so in its plan): torchverity "
        "migrate extracts the tensors and the plain data into a weights-only state_dict.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "cant-get-attribute",
        r"Can't get attribute '(?P<attr>[\w.]+)' on <module '(?P<module>[\w.]+)'|"
        r"No module named '(?P<missing>[\w.]+)'",
        "the file pickles a whole object whose class{detail} is no longer where it was when "
        "saved (renamed, moved, or defined in a __main__ script).",
        "extract the tensors and plain data without the original code: torchverity migrate "
        "rebuilds unknown classes as inert placeholders; then load the state_dict into a model "
        "built by the current code.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "size-mismatch",
        r"size mismatch for (?P<key>[\w.]+): copying a param with shape "
        r"(?P<ckpt>" + _SHAPE + r") from checkpoint, the shape in current model "
        r"is (?P<model>" + _SHAPE + r")",
        "the model was built with a different configuration (vocabulary size, number of "
        "classes, hidden width) than the checkpoint{detail}.",
        "build the model with the configuration saved with the checkpoint (meta.json or "
        "hyperparameters); to see every differing tensor, compare the shapes the check lists "
        "for the file with those of model.state_dict().",
        "torchverity inspect {file} --limit 0",
        unit="tensors",
    ),
    _rule(
        "peft-adapter-keys",
        r"Unexpected key\(s\) in state_dict:[^\n]*?\.lora_(?:A|B|embedding_A|embedding_B)"
        r"\.weight\b",
        "the file is a PEFT adapter (adapter_model.safetensors / .bin): its keys leave out the "
        "adapter name the PeftModel's keys carry ('lora_A.weight' for 'lora_A.default.weight'), "
        "and it holds the adapter's tensors only, so load_state_dict on the whole model fails.",
        "load it the way peft does: PeftModel.from_pretrained(base, folder), or "
        "set_peft_model_state_dict(model, torchverity.load(path)) to verify the file first.",
        "torchverity inspect {file}",
    ),
    _rule(
        "missing-unexpected-keys",
        r"(?P<kind>Missing|Unexpected) key\(s\) in state_dict(?=:?[ \t]*(?P<keys>[^\n]*))",
        "the state_dict keys do not match the model{detail}: a 'module.' prefix from "
        "DataParallel/DistributedDataParallel, an '_orig_mod.' prefix from torch.compile, or a "
        "different architecture.",
        "strip the prefix (consume_prefix_in_state_dict_if_present) or build the matching "
        "architecture; load with strict=False only after reading the list of keys.",
        "torchverity inspect {file}",
        unit="keys",
    ),
    _rule(
        "cuda-on-cpu",
        r"Attempting to deserialize object on a CUDA device|"
        r"Attempting to deserialize object on CUDA device \d+ but torch\.cuda\.device_count",
        "the checkpoint holds tensors saved on a GPU, and this machine has no (or fewer) "
        "CUDA devices.",
        "load with map_location='cpu' (torchverity.load does by default), then move the model "
        "with model.to(device).",
        "torchverity inspect {file}",
    ),
    _rule(
        "different-devices",
        r"Expected all tensors to be on the same device",
        "a model and its inputs (or two parts of a model) live on different devices, often "
        "after loading a checkpoint with map_location='cpu' and moving only part of it.",
        "move the whole model after load_state_dict (model.to(device)) and the inputs with "
        "the same device; rebuild the optimizer after moving the model.",
        "torchverity inspect {file}",
    ),
    _rule(
        "not-torchscript",
        r"PytorchStreamReader failed locating file constants\.pkl",
        "torch.jit.load was given a torch.save checkpoint (a state_dict or pickled objects), "
        "not a TorchScript archive (torch.jit.save): only TorchScript archives hold "
        "constants.pkl.",
        "load it with torch.load(weights_only=True) and load_state_dict into the model your "
        "code builds; use torch.jit.load only for files written by torch.jit.save.",
        "torchverity inspect {file}",
    ),
    _rule(
        "missing-shard",
        r"No such file or directory:? '?(?P<shard>[^'\s]*(?:model|pytorch_model)-\d{5}-of-"
        r"\d{5}\.(?:safetensors|bin))",
        "a shard that the checkpoint's index names is not in the folder{detail}: an "
        "incomplete download or copy, or shards of another save beside this index.",
        "fetch the missing shards from the checkpoint's source (huggingface-cli download "
        "fetches what is missing); the folder's manifest, where there is one, says what "
        "belongs in it.",
        "torchverity verify {folder}",
    ),
    _rule(
        "checkpoint-not-found",
        r"Checkpoint file not found: (?P<absent>[^\s{}\"']+)\s*$|No such file or directory: '?"
        r"(?P<nofile>[^'\s]+\.(?:pt|pth|ckpt|bin|safetensors|pkl|tar))'?$",
        "the checkpoint{detail} is not at that path: a typo, or a relative path resolved "
        "from another working directory, a checkpoint removed by a retention policy "
        "(save_top_k, save_total_limit), or a copy or download that has not finished.",
        "look where the run saved it (the trainer's checkpoint folder) and pass that path; "
        "a folder's manifest lists what belongs in it.",
        "torchverity verify {folder}",
    ),
    _rule(
        "hf-no-weights",
        r"no file named [\w.,\s]+?,? found in directory (?P<where>\S+?)\.?$",
        "the model folder{detail} holds no weights file that transformers looks for: only "
        "its config and tokenizer were downloaded or copied, the weights are under another "
        "name, or the path is another folder of the repository.",
        "download the weights too (huggingface-cli download REPO, which fetches what is "
        "missing), or point from_pretrained at the folder that holds them.",
        "torchverity inspect {folder}",
    ),
    _rule(
        "config-not-json",
        r"the config file at '(?P<config>[^'{}]+)' is not a valid JSON file|"
        # the parser's error that transformers reports as the above, in the same traceback
        r"^json\.decoder\.JSONDecodeError: [^\n]*(?=[\s\S]*?is not a valid JSON file)",
        "the model's config.json{detail} is not JSON: damaged or cut short, or a Git LFS "
        "pointer or HTML page saved under its name.",
        "restore the file from a good copy or download it again; the folder's manifest "
        "tells a good copy.",
        "torchverity verify {folder}",
    ),
    _rule(
        "safetensors-not-safetensors",
        r"Error while deserializing header: header too large|HeaderTooLarge",
        "the file's first 8 bytes are not a safetensors header length: most often a Git LFS "
        "pointer or an HTML page saved under the .safetensors name (a broken download), else "
        "another format renamed .safetensors.",
        "see what the file is (the scan names LFS pointers and HTML pages); fetch the real "
        "file with 'git lfs pull' or download it again, then verify it.",
        "torchverity scan {file}",
    ),
    _rule(
        "truncated-zip",
        r"PytorchStreamReader failed (?:reading zip archive|finding central directory|"
        r"locating file (?!constants\.pkl))[^\n]*|failed finding central directory|"
        r"file is not a zip file|truncated|Ran out of input|^\s*(?:builtins\.)?EOFError\s*$|"
        r"Error while deserializing header: (?:header too small|invalid JSON in header)|"
        r"MetadataIncompleteBuffer|InvalidHeaderDeserialization|"
        r"Error while deserializing header: incomplete metadata, file not fully covered|"
        # torch >= 2.13 on a file cut short by a few bytes: the reader's errno, which only
        # the traceback line above it ties to the archive
        r"PyTorchFileReader\([^\n]*\n(?:[ \t^~]*\n)?OSError: \[Errno 22\] Invalid argument",
        "the file is incomplete or damaged: a save interrupted before it finished (torch.save "
        "is not atomic), a partial copy or download, or a full disk.",
        "check the file against its sidecar or manifest and restore a good copy; write "
        "checkpoints with torchverity.save, which writes atomically.",
        "torchverity verify {file}",
    ),
    _rule(
        "damaged-zip-record",
        r"PytorchStreamReader failed reading file (?P<record>\S+?):? invalid header or archive "
        r"is corrupted",
        "a record inside the checkpoint's zip archive{detail} is damaged (its header bytes "
        "changed "
        "after it was written): storage, copy or download corruption, not an interrupted save.",
        "verify the file against its sidecar or manifest and restore a good copy; torchverity "
        "diff against a good copy names the tensors that differ.",
        "torchverity verify {file}",
    ),
    _rule(
        "save-write-failed",
        r"\[enforce fail at inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+",
        "torch.save could not write the whole archive: the disk or quota is full, or the file "
        "system refused a write. The file it left is incomplete, and one saved over an older "
        "checkpoint has destroyed it (torch.save is not atomic).",
        "free space (df -h on the target) or save elsewhere; write checkpoints with "
        "torchverity.save, which leaves the previous checkpoint intact when a save fails.",
        "torchverity verify {file}",
    ),
    _rule(
        "transformers-unreadable-weights",
        r"Unable to load weights from pytorch checkpoint file for '(?P<weights>[^']+)'|"
        # what it raises on the way, while handling torch's error: a text file's probe, or
        # a binary file's failure to read as text
        r"Unable to locate the file \S+ which is necessary to load this pretrained model|"
        r"^UnicodeDecodeError: [^\n]*(?=[\s\S]*?Unable to load weights from pytorch checkpoint)",
        "transformers could not read the weights file{detail}; its message hides why: the "
        "error printed above it ('During handling of the above exception') is torch's. Most "
        "often the file is damaged or truncated, or an HTML page or another format saved "
        "under the weights name; rarely a TensorFlow checkpoint.",
        "check the file, then download it again or restore a good copy; explain the whole "
        "traceback to have torch's error named too.",
        "torchverity inspect {file}",
    ),
    _rule(
        "zip-crc",
        r"CRC[- ]?32|Bad CRC|CRC check failed|crc mismatch",
        "bytes inside the checkpoint changed after it was written (storage or transfer "
        "corruption). torch.load does not check zip CRCs, so such damage usually loads silently.",
        "verify the file against its sidecar and restore a good copy if it differs.",
        "torchverity verify {file}",
    ),
    _rule(
        "not-a-pickle",
        r"invalid load key, '(?!v'|<')(?P<loadkey>[^']*)'",
        "the file is not a checkpoint: often a Git LFS pointer (load key 'v'), an HTML error "
        "page from a download (load key '<'), or a corrupted file.",
        "run 'git lfs pull' or download the file again, then verify it.",
        "torchverity verify {file}",
    ),
    _rule(
        "cuda-hardware",
        r"uncorrectable ECC error|ECC error|\bXid\b|GPU has fallen off the bus|"
        r"unspecified launch failure|an illegal memory access was encountered",
        "the GPU reported a fault that points to hardware (ECC, Xid, lost device), which can "
        "also corrupt data silently before it surfaces as an error.",
        "drain the node, check 'nvidia-smi -q -d ECC' and the kernel log for Xid codes, verify "
        "checkpoints written since the last good one, and run the device self-test.",
        "torchverity selftest",
    ),
)
