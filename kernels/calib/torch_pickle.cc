#include "kernels/calib/torch_pickle.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace oscarkv {
namespace {

uint32_t Crc32(const char* data, size_t n) {
  static const auto* table = [] {
    auto* t = new uint32_t[256];
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ uint8_t(data[i])) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t Le(const std::string& b, size_t pos, int bytes) {
  uint32_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint32_t(uint8_t(b[pos + i])) << (8 * i);
  return v;
}

absl::Status ZipError(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("zip archive: ", what));
}

absl::Status PickleError(size_t pos, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("pickle at byte ", pos, ": ", what));
}

PyRef Make(PyValue::Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}

bool IsTensorRebuild(const PyValue& v) {
  return v.kind == PyValue::Kind::kGlobal && v.s == "torch._utils _rebuild_tensor_v2";
}

}  // namespace

PyRef PyValue::Get(const std::string& key) const {
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::kString && k->s == key) return v;
  }
  return nullptr;
}

PyRef PyValue::Get(int64_t key) const {
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::kInt && k->i == key) return v;
  }
  return nullptr;
}

absl::StatusOr<std::map<std::string, std::string>> ReadStoredZip(const std::string& b) {
  if (b.size() < 22) return ZipError(absl::StrCat("file is ", b.size(), " bytes: truncated"));
  // End of central directory: last occurrence of its signature.
  size_t eocd = std::string::npos;
  const size_t lowest = b.size() > 22 + 65535 ? b.size() - 22 - 65535 : 0;
  for (size_t p = b.size() - 22 + 1; p-- > lowest;) {
    if (Le(b, p, 4) == 0x06054b50u) {
      eocd = p;
      break;
    }
  }
  if (eocd == std::string::npos) {
    return ZipError("no end-of-central-directory record (truncated or not a zip file)");
  }
  const uint32_t count = Le(b, eocd + 10, 2);
  const uint32_t cd_size = Le(b, eocd + 12, 4), cd_off = Le(b, eocd + 16, 4);
  if (count == 0xffff || cd_off == 0xffffffffu) return ZipError("zip64 archives are not supported");
  if (uint64_t(cd_off) + cd_size > eocd) return ZipError("central directory outside the file");
  std::map<std::string, std::string> out;
  size_t p = cd_off;
  for (uint32_t e = 0; e < count; ++e) {
    if (p + 46 > eocd || Le(b, p, 4) != 0x02014b50u) {
      return ZipError(absl::StrCat("central directory entry ", e, " is corrupt"));
    }
    const uint32_t method = Le(b, p + 10, 2), crc = Le(b, p + 16, 4);
    const uint32_t csize = Le(b, p + 20, 4), usize = Le(b, p + 24, 4);
    const uint32_t nlen = Le(b, p + 28, 2), xlen = Le(b, p + 30, 2), clen = Le(b, p + 32, 2);
    const uint32_t local = Le(b, p + 42, 4);
    if (p + 46 + nlen > eocd) return ZipError("central directory name outside the file");
    const std::string name = b.substr(p + 46, nlen);
    p += 46 + nlen + xlen + clen;
    if (method != 0) {
      return ZipError(absl::StrCat("entry \"", name, "\" is compressed (method ", method,
                                   "); torch.save writes stored entries only"));
    }
    if (csize != usize) return ZipError(absl::StrCat("entry \"", name, "\": size mismatch"));
    if (uint64_t(local) + 30 > b.size() || Le(b, local, 4) != 0x04034b50u) {
      return ZipError(absl::StrCat("entry \"", name, "\": local header missing or corrupt"));
    }
    const uint64_t data = uint64_t(local) + 30 + Le(b, local + 26, 2) + Le(b, local + 28, 2);
    if (data + csize > b.size()) {
      return ZipError(absl::StrCat("entry \"", name, "\" extends past the end of the file (truncated)"));
    }
    std::string contents = b.substr(data, csize);
    if (Crc32(contents.data(), contents.size()) != crc) {
      return ZipError(absl::StrCat("entry \"", name, "\" fails its CRC-32 check (corrupted)"));
    }
    out[name] = std::move(contents);
  }
  return out;
}

absl::StatusOr<PyRef> RestrictedUnpickle(const std::string& s) {
  std::vector<PyRef> stack;
  std::vector<size_t> marks;
  std::map<uint32_t, PyRef> memo;
  size_t p = 0;
  auto need = [&](size_t n) { return p + n <= s.size(); };
  auto pop = [&]() -> PyRef {
    PyRef v = stack.back();
    stack.pop_back();
    return v;
  };
  auto pop_mark = [&](std::vector<PyRef>* items) -> bool {
    if (marks.empty()) return false;
    const size_t m = marks.back();
    marks.pop_back();
    if (m > stack.size()) return false;
    items->assign(stack.begin() + m, stack.end());
    stack.resize(m);
    return true;
  };
  constexpr size_t kMaxStack = 1 << 20;
  while (p < s.size()) {
    const size_t at = p;
    const uint8_t op = uint8_t(s[p++]);
    if (stack.size() > kMaxStack) return PickleError(at, "stack too deep");
    switch (op) {
      case 0x80:  // PROTO
        if (!need(1)) return PickleError(at, "truncated PROTO");
        if (uint8_t(s[p]) > 4) return PickleError(at, "pickle protocol > 4 not supported");
        p += 1;
        break;
      case 0x95:  // FRAME
        if (!need(8)) return PickleError(at, "truncated FRAME");
        p += 8;
        break;
      case '.': {  // STOP
        if (stack.size() != 1) return PickleError(at, "STOP with a malformed stack");
        return stack.back();
      }
      case '(':
        marks.push_back(stack.size());
        break;
      case '}':
        stack.push_back(Make(PyValue::Kind::kDict));
        break;
      case ']':
        stack.push_back(Make(PyValue::Kind::kList));
        break;
      case ')':
        stack.push_back(Make(PyValue::Kind::kTuple));
        break;
      case 'N':
        stack.push_back(Make(PyValue::Kind::kNone));
        break;
      case 0x88:
      case 0x89: {
        PyRef v = Make(PyValue::Kind::kBool);
        v->i = op == 0x88;
        stack.push_back(v);
        break;
      }
      case 'K':
      case 'M':
      case 'J': {
        const int n = op == 'K' ? 1 : op == 'M' ? 2 : 4;
        if (!need(n)) return PickleError(at, "truncated integer");
        PyRef v = Make(PyValue::Kind::kInt);
        const uint32_t u = Le(s, p, n);
        v->i = op == 'J' ? int64_t(int32_t(u)) : int64_t(u);
        p += n;
        stack.push_back(v);
        break;
      }
      case 0x8a: {  // LONG1
        if (!need(1)) return PickleError(at, "truncated LONG1");
        const int n = uint8_t(s[p++]);
        if (n > 8 || !need(n)) return PickleError(at, "LONG1 too long");
        int64_t v = 0;
        for (int i = 0; i < n; ++i) v |= int64_t(uint8_t(s[p + i])) << (8 * i);
        if (n > 0 && n < 8 && (uint8_t(s[p + n - 1]) & 0x80)) v -= int64_t(1) << (8 * n);
        p += n;
        PyRef r = Make(PyValue::Kind::kInt);
        r->i = v;
        stack.push_back(r);
        break;
      }
      case 'G': {  // BINFLOAT, big-endian
        if (!need(8)) return PickleError(at, "truncated BINFLOAT");
        uint64_t u = 0;
        for (int i = 0; i < 8; ++i) u = (u << 8) | uint8_t(s[p + i]);
        p += 8;
        PyRef v = Make(PyValue::Kind::kFloat);
        std::memcpy(&v->f, &u, 8);
        stack.push_back(v);
        break;
      }
      case 'X':
      case 0x8c: {  // BINUNICODE, SHORT_BINUNICODE
        const int n = op == 'X' ? 4 : 1;
        if (!need(n)) return PickleError(at, "truncated string length");
        const uint32_t len = Le(s, p, n);
        p += n;
        if (!need(len)) return PickleError(at, "string runs past the end");
        PyRef v = Make(PyValue::Kind::kString);
        v->s = s.substr(p, len);
        p += len;
        stack.push_back(v);
        break;
      }
      case 'c': {  // GLOBAL "module\nname\n"
        const size_t nl1 = s.find('\n', p);
        const size_t nl2 = nl1 == std::string::npos ? nl1 : s.find('\n', nl1 + 1);
        if (nl2 == std::string::npos) return PickleError(at, "truncated GLOBAL");
        PyRef v = Make(PyValue::Kind::kGlobal);
        v->s = s.substr(p, nl1 - p) + " " + s.substr(nl1 + 1, nl2 - nl1 - 1);
        p = nl2 + 1;
        if (v->s != "torch._utils _rebuild_tensor_v2" && v->s != "torch FloatStorage" &&
            v->s != "torch DoubleStorage" && v->s != "collections OrderedDict") {
          return PickleError(at, absl::StrCat("refusing global \"", v->s,
                                              "\" (only fp32 tensors in plain dicts are accepted)"));
        }
        stack.push_back(v);
        break;
      }
      case 'q':
      case 'r':
      case 'h':
      case 'j': {  // BINPUT, LONG_BINPUT, BINGET, LONG_BINGET
        const int n = (op == 'q' || op == 'h') ? 1 : 4;
        if (!need(n)) return PickleError(at, "truncated memo index");
        const uint32_t idx = Le(s, p, n);
        p += n;
        if (op == 'q' || op == 'r') {
          if (stack.empty()) return PickleError(at, "PUT on an empty stack");
          memo[idx] = stack.back();
        } else {
          auto it = memo.find(idx);
          if (it == memo.end()) return PickleError(at, absl::StrCat("GET of unknown memo ", idx));
          stack.push_back(it->second);
        }
        break;
      }
      case 0x94:  // MEMOIZE
        if (stack.empty()) return PickleError(at, "MEMOIZE on an empty stack");
        memo[uint32_t(memo.size())] = stack.back();
        break;
      case 't':
      case 0x85:
      case 0x86:
      case 0x87: {
        PyRef v = Make(PyValue::Kind::kTuple);
        if (op == 't') {
          if (!pop_mark(&v->items)) return PickleError(at, "TUPLE without MARK");
        } else {
          const size_t n = op - 0x84;
          if (stack.size() < n) return PickleError(at, "TUPLEn on a short stack");
          v->items.assign(stack.end() - n, stack.end());
          stack.resize(stack.size() - n);
        }
        stack.push_back(v);
        break;
      }
      case 'a':
      case 'e': {  // APPEND, APPENDS
        std::vector<PyRef> items;
        if (op == 'a') {
          if (stack.size() < 2) return PickleError(at, "APPEND on a short stack");
          items.push_back(pop());
        } else if (!pop_mark(&items)) {
          return PickleError(at, "APPENDS without MARK");
        }
        if (stack.empty() || stack.back()->kind != PyValue::Kind::kList) {
          return PickleError(at, "APPEND to a non-list");
        }
        for (auto& x : items) stack.back()->items.push_back(x);
        break;
      }
      case 's':
      case 'u': {  // SETITEM, SETITEMS
        std::vector<PyRef> items;
        if (op == 's') {
          if (stack.size() < 3) return PickleError(at, "SETITEM on a short stack");
          PyRef v = pop(), k = pop();
          items = {k, v};
        } else if (!pop_mark(&items)) {
          return PickleError(at, "SETITEMS without MARK");
        }
        if (items.size() % 2 != 0) return PickleError(at, "odd number of dict items");
        if (stack.empty() || stack.back()->kind != PyValue::Kind::kDict) {
          return PickleError(at, "SETITEM on a non-dict");
        }
        for (size_t i = 0; i < items.size(); i += 2) {
          stack.back()->entries.push_back({items[i], items[i + 1]});
        }
        break;
      }
      case 'Q': {  // BINPERSID: ('storage', StorageType, key, location, numel)
        if (stack.empty()) return PickleError(at, "BINPERSID on an empty stack");
        PyRef pid = pop();
        if (pid->kind != PyValue::Kind::kTuple || pid->items.size() != 5 ||
            pid->items[0]->kind != PyValue::Kind::kString || pid->items[0]->s != "storage" ||
            pid->items[1]->kind != PyValue::Kind::kGlobal ||
            pid->items[2]->kind != PyValue::Kind::kString ||
            pid->items[4]->kind != PyValue::Kind::kInt) {
          return PickleError(at, "unexpected persistent id (not a torch storage)");
        }
        PyRef st = Make(PyValue::Kind::kStorage);
        st->storage_type = pid->items[1]->s == "torch FloatStorage" ? "float" : "double";
        st->s = pid->items[2]->s;
        st->i = pid->items[4]->i;
        stack.push_back(st);
        break;
      }
      case 'R': {  // REDUCE
        if (stack.size() < 2) return PickleError(at, "REDUCE on a short stack");
        PyRef args = pop(), fn = pop();
        if (fn->kind != PyValue::Kind::kGlobal || args->kind != PyValue::Kind::kTuple) {
          return PickleError(at, "REDUCE of a non-global");
        }
        if (fn->s == "collections OrderedDict") {
          if (!args->items.empty()) return PickleError(at, "OrderedDict with arguments");
          stack.push_back(Make(PyValue::Kind::kDict));
        } else if (IsTensorRebuild(*fn)) {
          // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
          const auto& a = args->items;
          if (a.size() < 4 || a[0]->kind != PyValue::Kind::kStorage ||
              a[1]->kind != PyValue::Kind::kInt || a[2]->kind != PyValue::Kind::kTuple ||
              a[3]->kind != PyValue::Kind::kTuple) {
            return PickleError(at, "malformed _rebuild_tensor_v2 arguments");
          }
          PyRef t = Make(PyValue::Kind::kTensor);
          t->storage = a[0];
          t->offset = a[1]->i;
          for (const auto& x : a[2]->items) {
            if (x->kind != PyValue::Kind::kInt) return PickleError(at, "non-integer tensor size");
            t->shape.push_back(x->i);
          }
          for (const auto& x : a[3]->items) {
            if (x->kind != PyValue::Kind::kInt) return PickleError(at, "non-integer tensor stride");
            t->stride.push_back(x->i);
          }
          stack.push_back(t);
        } else {
          return PickleError(at, absl::StrCat("refusing to call \"", fn->s, "\""));
        }
        break;
      }
      default:
        return PickleError(at, absl::StrCat("unsupported opcode 0x", absl::Hex(op)));
    }
  }
  return PickleError(p, "no STOP opcode (truncated pickle)");
}

absl::StatusOr<TorchArchive> ReadTorchArchive(const std::string& bytes) {
  OSCARKV_ASSIGN_OR_RETURN(auto entries, ReadStoredZip(bytes));
  std::string prefix;
  const std::string* pickle = nullptr;
  for (const auto& [name, data] : entries) {
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.substr(slash + 1) == "data.pkl") {
      prefix = name.substr(0, slash + 1);
      pickle = &data;
    }
  }
  if (pickle == nullptr) {
    return absl::InvalidArgumentError("not a torch.save archive: no <name>/data.pkl entry");
  }
  auto bo = entries.find(prefix + "byteorder");
  if (bo != entries.end() && bo->second != "little") {
    return absl::InvalidArgumentError(absl::StrCat("torch archive byteorder is \"", bo->second,
                                                   "\"; only little-endian is supported"));
  }
  TorchArchive archive;
  auto root = RestrictedUnpickle(*pickle);
  if (!root.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "data.pkl: ", root.status().message()));
  }
  archive.root = *root;
  const std::string data_prefix = prefix + "data/";
  for (auto& [name, data] : entries) {
    if (name.rfind(data_prefix, 0) == 0) archive.storages[name.substr(data_prefix.size())] = data;
  }
  return archive;
}

absl::StatusOr<std::vector<float>> TensorFloats(const TorchArchive& archive, const PyValue& t) {
  if (t.kind != PyValue::Kind::kTensor || !t.storage) {
    return absl::InvalidArgumentError("expected a tensor");
  }
  if (t.storage->storage_type != "float") {
    return absl::InvalidArgumentError("tensor is not fp32 (torch.FloatStorage)");
  }
  if (t.shape.size() != t.stride.size()) return absl::InvalidArgumentError("tensor stride rank mismatch");
  int64_t numel = 1, expect_stride = 1;
  for (int i = int(t.shape.size()) - 1; i >= 0; --i) {
    if (t.shape[i] < 0 || t.shape[i] > (int64_t(1) << 31)) {
      return absl::InvalidArgumentError("tensor size out of range");
    }
    if (t.shape[i] > 1 && t.stride[i] != expect_stride) {
      return absl::InvalidArgumentError("tensor is not contiguous");
    }
    expect_stride *= t.shape[i];
    numel *= t.shape[i];
    if (numel > (int64_t(1) << 40)) return absl::InvalidArgumentError("tensor too large");
  }
  auto it = archive.storages.find(t.storage->s);
  if (it == archive.storages.end()) {
    return absl::InvalidArgumentError(absl::StrCat("storage data/", t.storage->s, " missing from the archive"));
  }
  const std::string& data = it->second;
  const int64_t storage_elems = int64_t(data.size() / 4);
  if (t.offset < 0 || t.offset > storage_elems || numel > storage_elems - t.offset ||
      storage_elems != t.storage->i || data.size() % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("storage data/", t.storage->s, " has ",
                                                   data.size(), " bytes, too few for the tensor"));
  }
  std::vector<float> out(numel);
  std::memcpy(out.data(), data.data() + t.offset * 4, size_t(numel) * 4);
  return out;
}

}  // namespace oscarkv
