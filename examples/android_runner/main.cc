// A minimal ExecuTorch host for an exported OSCAR model: the code an Android app's JNI layer
// holds, built here against the executorch wheel. It loads model.pte with the low-level runtime
// API (FileDataLoader, Program, MemoryManager, Method), with the oscar::attention kernel linked
// in (liboscar_executorch.so registers it at load), prefills the prompt's token ids, decodes
// greedily and prints the generated ids and, given a byte-level BPE tokenizer.json, the text.
//
//   oscar_android_runner MODEL.pte IDS [MAX_NEW_TOKENS] [TOKENIZER.json]
//
// IDS are the prompt's token ids, comma-separated (tokenize on the app side, e.g. with
// ExecuTorch's tokenizers library). Output: "tokens: 1 2 3" then "text: ...".
#include <executorch/extension/data_loader/file_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::aten::TensorImpl;
using executorch::extension::FileDataLoader;
using executorch::extension::MallocMemoryAllocator;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::HierarchicalAllocator;
using executorch::runtime::MemoryManager;
using executorch::runtime::Method;
using executorch::runtime::Program;
using executorch::runtime::Span;

extern "C" const char* oscar_executorch_last_error();  // liboscar_executorch.so

namespace {

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "oscar_android_runner: error: %s\n", message.c_str());
  std::exit(1);
}

// One method with its own planned memory (the cache lives there between calls).
struct LoadedMethod {
  std::vector<std::vector<uint8_t>> planned;
  std::vector<Span<uint8_t>> spans;
  std::unique_ptr<HierarchicalAllocator> planned_memory;
  MallocMemoryAllocator method_allocator, temp_allocator;
  std::unique_ptr<MemoryManager> memory;
  std::unique_ptr<Method> method;

  LoadedMethod(const Program& program, const char* name) {
    auto meta = program.method_meta(name);
    if (!meta.ok()) die(std::string("model has no method '") + name + "': expected an oscar-export android .pte");
    for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i)
      planned.emplace_back(size_t(meta->memory_planned_buffer_size(i).get()));
    for (auto& buffer : planned) spans.emplace_back(buffer.data(), buffer.size());
    planned_memory = std::make_unique<HierarchicalAllocator>(Span<Span<uint8_t>>(spans.data(), spans.size()));
    memory = std::make_unique<MemoryManager>(&method_allocator, planned_memory.get(), &temp_allocator);
    auto loaded = program.load_method(name, memory.get());
    if (!loaded.ok())
      die(std::string("cannot load method '") + name + "' (error " + std::to_string(int(loaded.error())) +
          "): a missing operator oscar::attention.out means liboscar_executorch.so is not linked or loaded");
    method = std::make_unique<Method>(std::move(loaded.get()));
  }
};

int64_t constant(const Program& program, const char* name) {
  LoadedMethod m(program, name);
  if (m.method->execute() != Error::Ok) die(std::string("metadata method '") + name + "' failed");
  return m.method->get_output(0).toInt();
}

// Logits of the last position after running `ids` at positions start .. start+n-1.
std::vector<float> step(Method& method, std::vector<int64_t> ids, int64_t start) {
  executorch::aten::SizesType tok_sizes[2] = {1, executorch::aten::SizesType(ids.size())};
  executorch::aten::DimOrderType tok_order[2] = {0, 1};
  TensorImpl tokens(ScalarType::Long, 2, tok_sizes, ids.data(), tok_order);
  executorch::aten::SizesType pos_sizes[1] = {1};
  executorch::aten::DimOrderType pos_order[1] = {0};
  TensorImpl pos(ScalarType::Long, 1, pos_sizes, &start, pos_order);
  if (method.set_input(EValue(Tensor(&tokens)), 0) != Error::Ok || method.set_input(EValue(Tensor(&pos)), 1) != Error::Ok)
    die("cannot set the inputs: expected at most get_max_seq_len tokens per call");
  if (method.execute() != Error::Ok) die(std::string("forward failed: ") + oscar_executorch_last_error());
  const Tensor logits = method.get_output(0).toTensor();
  const int64_t vocab = logits.size(logits.dim() - 1);
  const float* last = logits.const_data_ptr<float>() + logits.numel() - vocab;
  return std::vector<float>(last, last + vocab);
}

// --- byte-level BPE decoding from tokenizer.json (vocab strings map bytes to printable code points)

std::string read_json_string(const std::string& s, size_t& i) {  // s[i] == '"'
  std::string out;
  for (++i; i < s.size() && s[i] != '"'; ++i) {
    if (s[i] != '\\') { out += s[i]; continue; }
    const char e = s[++i];
    if (e == 'u') {
      unsigned cp = std::stoul(s.substr(i + 1, 4), nullptr, 16);
      i += 4;
      if (cp >= 0xD800 && cp < 0xDC00 && s.compare(i + 1, 2, "\\u") == 0) {  // surrogate pair
        cp = 0x10000 + ((cp - 0xD800) << 10) + (std::stoul(s.substr(i + 3, 4), nullptr, 16) - 0xDC00);
        i += 6;
      }
      if (cp < 0x80) out += char(cp);
      else if (cp < 0x800) out += char(0xC0 | cp >> 6), out += char(0x80 | (cp & 0x3F));
      else if (cp < 0x10000) out += char(0xE0 | cp >> 12), out += char(0x80 | (cp >> 6 & 0x3F)), out += char(0x80 | (cp & 0x3F));
      else out += char(0xF0 | cp >> 18), out += char(0x80 | (cp >> 12 & 0x3F)), out += char(0x80 | (cp >> 6 & 0x3F)), out += char(0x80 | (cp & 0x3F));
    } else {
      out += e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == 'b' ? '\b' : e == 'f' ? '\f' : e;
    }
  }
  return out;
}

// id -> token string, from "model": {"vocab": {"tok": id, ...}} (added tokens share those ids).
std::map<int64_t, std::string> read_vocab(const std::string& path) {
  std::ifstream f(path);
  if (!f) die("cannot read " + path);
  std::stringstream buffer;
  buffer << f.rdbuf();
  const std::string s = buffer.str();
  size_t i = s.find("\"vocab\"");
  if (i == std::string::npos || (i = s.find('{', i)) == std::string::npos) die(path + ": no model.vocab object");
  std::map<int64_t, std::string> vocab;
  while (true) {
    i = s.find_first_of("\"}", i + 1);
    if (i == std::string::npos || s[i] == '}') break;
    std::string token = read_json_string(s, i);
    i = s.find(':', i);
    vocab[std::strtoll(s.c_str() + i + 1, nullptr, 10)] = token;
  }
  return vocab;
}

// GPT-2's byte <-> code point table: printable bytes map to themselves, the rest to 256 + n.
std::string bytes_from_byte_level(const std::string& utf8) {
  std::map<unsigned, unsigned char> inverse;
  unsigned next = 256;
  for (unsigned b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    inverse[printable ? b : next++] = static_cast<unsigned char>(b);
  }
  std::string out;
  for (size_t i = 0; i < utf8.size();) {
    unsigned char c = utf8[i];
    unsigned cp;
    int n;
    if (c < 0x80) cp = c, n = 1;
    else if (c >> 5 == 6) cp = c & 0x1F, n = 2;
    else if (c >> 4 == 14) cp = c & 0x0F, n = 3;
    else cp = c & 0x07, n = 4;
    for (int k = 1; k < n && i + k < utf8.size(); ++k) cp = cp << 6 | (utf8[i + k] & 0x3F);
    i += n;
    auto it = inverse.find(cp);
    if (it != inverse.end()) out += char(it->second);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) die("usage: oscar_android_runner MODEL.pte IDS [MAX_NEW_TOKENS] [TOKENIZER.json]");
  std::vector<int64_t> prompt;
  std::stringstream ids(argv[2]);
  for (std::string item; std::getline(ids, item, ',');) prompt.push_back(std::strtoll(item.c_str(), nullptr, 10));
  const long max_new = argc > 3 ? std::strtol(argv[3], nullptr, 10) : 64;
  if (prompt.empty() || max_new <= 0) die("expected comma-separated prompt token ids and a positive MAX_NEW_TOKENS");

  executorch::runtime::runtime_init();
  auto loader = FileDataLoader::from(argv[1]);
  if (!loader.ok()) die(std::string("cannot open ") + argv[1]);
  auto program = Program::load(&loader.get(), Program::Verification::Minimal);
  if (!program.ok()) die(std::string(argv[1]) + " is not an ExecuTorch program");

  const int64_t max_chunk = constant(program.get(), "get_max_seq_len");
  const int64_t max_context = constant(program.get(), "get_max_context_len");
  if (int64_t(prompt.size()) + max_new > max_context)
    die("prompt + MAX_NEW_TOKENS = " + std::to_string(prompt.size() + max_new) + " tokens > max context " +
        std::to_string(max_context));
  std::vector<int64_t> eos;
  {
    LoadedMethod m(program.get(), "get_eos_ids");
    if (m.method->execute() == Error::Ok)
      for (size_t i = 0; i < m.method->outputs_size(); ++i) eos.push_back(m.method->get_output(i).toInt());
  }

  LoadedMethod forward(program.get(), "forward");
  std::vector<float> logits;
  int64_t length = 0;
  for (size_t start = 0; start < prompt.size(); start += max_chunk) {  // prefill in chunks
    std::vector<int64_t> chunk(prompt.begin() + start, prompt.begin() + std::min(prompt.size(), start + max_chunk));
    logits = step(*forward.method, chunk, length);
    length += int64_t(chunk.size());
  }
  std::vector<int64_t> generated;
  while (long(generated.size()) < max_new) {
    int64_t best = 0;
    for (size_t v = 1; v < logits.size(); ++v)
      if (logits[v] > logits[best]) best = int64_t(v);
    generated.push_back(best);
    bool stop = long(generated.size()) == max_new;
    for (int64_t e : eos) stop = stop || best == e;
    if (stop) break;
    logits = step(*forward.method, {best}, length++);
  }
  std::printf("tokens:");
  for (int64_t t : generated) std::printf(" %lld", static_cast<long long>(t));
  std::printf("\n");
  if (argc > 4) {
    const auto vocab = read_vocab(argv[4]);
    std::string text;
    for (int64_t t : generated) {
      auto it = vocab.find(t);
      text += it == vocab.end() ? std::string() : it->second;
    }
    std::printf("text: %s\n", bytes_from_byte_level(text).c_str());
  }
  return 0;
}
